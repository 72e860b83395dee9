//! The TCP server of a store replica: one thread accepting, one per connection, over a shared
//! [`L3Store`]. Serving starts before loadback ends (DESIGN contract 7); every request answers at
//! once (a key not yet loaded back is a miss).

use std::io::{BufReader, BufWriter};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::manifest::ObjectKey;
use super::store::{L3Store, PutOutcome};
use super::wire::{Op, Status, WireError, read_frame, split_put, write_frame};

/// Open connections: the stream (to shut it down at stop) and the thread serving it.
type ConnTable = Arc<Mutex<Vec<(TcpStream, JoinHandle<()>)>>>;

/// A running server. [`L3Server::stop`] (or drop) stops accepting, closes every connection and
/// joins every thread (DESIGN contract 9).
pub struct L3Server {
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    conns: ConnTable,
    acceptor: Option<JoinHandle<()>>,
}

impl L3Server {
    /// Binds `listen` and serves `store`.
    ///
    /// # Errors
    /// The bind or spawn error.
    pub fn start(store: Arc<L3Store>, listen: SocketAddr) -> std::io::Result<L3Server> {
        let listener = TcpListener::bind(listen)?;
        let addr = listener.local_addr()?;
        let stopping = Arc::new(AtomicBool::new(false));
        let conns: ConnTable = Arc::default();
        let (stop, table) = (Arc::clone(&stopping), Arc::clone(&conns));
        let acceptor = std::thread::Builder::new()
            .name("l3-accept".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let stream = match stream {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!(error = %e, "L3 accept failed");
                            continue;
                        }
                    };
                    let Ok(handle_side) = stream.try_clone() else {
                        continue;
                    };
                    let store = Arc::clone(&store);
                    let spawned = std::thread::Builder::new()
                        .name("l3-conn".into())
                        .spawn(move || serve_connection(&store, handle_side));
                    match spawned {
                        Ok(h) => {
                            let mut t = table.lock().unwrap_or_else(|p| p.into_inner());
                            t.retain(|(_, h)| !h.is_finished());
                            t.push((stream, h));
                        }
                        Err(e) => tracing::warn!(error = %e, "cannot spawn L3 connection thread"),
                    }
                }
            })?;
        Ok(L3Server {
            addr,
            stopping,
            conns,
            acceptor: Some(acceptor),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving: no new connections, open ones closed, threads joined. Idempotent.
    pub fn stop(&mut self) {
        let _ = self.stop_checked();
    }

    /// [`Self::stop`], telling what went wrong: `Err` names the threads that had panicked (their
    /// connections were cut all the same). A second call is `Ok(())`.
    ///
    /// # Errors
    /// The panicked accept or connection threads, counted.
    pub fn stop_checked(&mut self) -> Result<(), String> {
        if self.stopping.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // Wake the blocking accept.
        let _ = TcpStream::connect(self.addr);
        let mut panicked = Vec::new();
        if let Some(a) = self.acceptor.take()
            && a.join().is_err()
        {
            tracing::error!("L3 accept thread panicked");
            panicked.push("the accept thread".to_owned());
        }
        let conns = std::mem::take(&mut *self.conns.lock().unwrap_or_else(|p| p.into_inner()));
        let mut conn_panics = 0;
        for (stream, handle) in conns {
            let _ = stream.shutdown(Shutdown::Both);
            if handle.join().is_err() {
                tracing::error!("L3 connection thread panicked");
                conn_panics += 1;
            }
        }
        if conn_panics > 0 {
            panicked.push(format!("{conn_panics} connection thread(s)"));
        }
        match panicked.is_empty() {
            true => Ok(()),
            false => Err(format!("panicked: {}", panicked.join(", "))),
        }
    }
}

impl Drop for L3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn serve_connection(store: &L3Store, stream: TcpStream) {
    let peer = stream.peer_addr().ok();
    let Ok(write_side) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut writer = BufWriter::new(write_side);
    loop {
        let frame = match read_frame(&mut reader) {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(?peer, error = %e, "L3 connection closed");
                // Best effort: tell the peer why before closing.
                let _ = write_frame(
                    &mut writer,
                    Status::Error as u8,
                    &[e.to_string().as_bytes()],
                );
                return;
            }
        };
        if let Err(e) = answer(store, frame, &mut writer) {
            tracing::debug!(?peer, error = %e, "L3 connection closed");
            return;
        }
    }
}

/// Body of [`Op::Hot`].
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct HotQuery {
    /// Writer shard.
    pub shard: super::manifest::ShardCoords,
    /// Pool.
    pub pool: crate::memory::pool::PoolRole,
    /// Most keys answered.
    pub limit: usize,
}

fn parse_key(bytes: &[u8]) -> Result<ObjectKey, WireError> {
    serde_json::from_slice(bytes).map_err(|e| WireError::Malformed(format!("object key: {e}")))
}

fn answer(
    store: &L3Store,
    (code, body): (u8, Vec<u8>),
    w: &mut impl std::io::Write,
) -> Result<(), WireError> {
    let error = |w: &mut _, msg: String| write_frame(w, Status::Error as u8, &[msg.as_bytes()]);
    let op = match Op::try_from(code) {
        Ok(op) => op,
        Err(e) => return error(w, e.to_string()),
    };
    match op {
        Op::Put => {
            let (key, data) = match split_put(&body).and_then(|(k, d)| Ok((parse_key(k)?, d))) {
                Ok(kd) => kd,
                Err(e) => return error(w, e.to_string()),
            };
            match store.put(key, data) {
                Ok(PutOutcome::Stored) => write_frame(w, Status::Ok as u8, &[&[1]]),
                Ok(PutOutcome::AlreadyPresent) => write_frame(w, Status::Ok as u8, &[&[0]]),
                Err(e) => error(w, e.to_string()),
            }
        }
        Op::Get => match parse_key(&body) {
            Ok(key) => match store.get(&key) {
                Some(bytes) => write_frame(w, Status::Ok as u8, &[&bytes]),
                None => write_frame(w, Status::Miss as u8, &[]),
            },
            Err(e) => error(w, e.to_string()),
        },
        Op::Lookup => match serde_json::from_slice::<Vec<ObjectKey>>(&body) {
            Ok(keys) => {
                let n = store.leading_present(&keys) as u64;
                write_frame(w, Status::Ok as u8, &[&n.to_le_bytes()])
            }
            Err(e) => error(w, format!("lookup keys: {e}")),
        },
        Op::Hot => match serde_json::from_slice::<HotQuery>(&body) {
            Ok(q) => match serde_json::to_vec(&store.hot_keys(q.shard, q.pool, q.limit)) {
                Ok(json) => write_frame(w, Status::Ok as u8, &[&json]),
                Err(e) => error(w, format!("hot keys: {e}")),
            },
            Err(e) => error(w, format!("hot query: {e}")),
        },
        Op::Health => match serde_json::to_vec(&store.health()) {
            Ok(json) => write_frame(w, Status::Ok as u8, &[&json]),
            Err(e) => error(w, format!("health: {e}")),
        },
    }
}
