//! A blocking client of a store replica over the [`wire`](super::wire) protocol: what a store
//! client (embedded or standalone) and the restart tests use.

use std::io::{BufReader, BufWriter};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use super::manifest::ObjectKey;
use super::replay::L3Backend;
use super::store::L3Health;
use super::wire::{Op, Status, WireError, read_frame, write_frame};

/// Errors of client calls.
#[derive(Debug, thiserror::Error)]
pub enum L3ClientError {
    /// The connection or a frame failed.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The server answered `ERROR`.
    #[error("L3 server: {0}")]
    Server(String),
    /// The server answered something the protocol does not allow for this request.
    #[error("unexpected L3 response: {0}")]
    Protocol(String),
}

struct Conn {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

/// One connection to a store replica; calls are serialised on it.
pub struct L3Client {
    conn: Mutex<Conn>,
}

impl L3Client {
    /// Connects with a timeout; reads and writes time out after `io_timeout`.
    ///
    /// # Errors
    /// [`L3ClientError::Wire`] on connect failure.
    pub fn connect(addr: SocketAddr, io_timeout: Duration) -> Result<Self, L3ClientError> {
        let stream = TcpStream::connect_timeout(&addr, io_timeout).map_err(WireError::from)?;
        stream
            .set_read_timeout(Some(io_timeout))
            .map_err(WireError::from)?;
        stream
            .set_write_timeout(Some(io_timeout))
            .map_err(WireError::from)?;
        stream.set_nodelay(true).map_err(WireError::from)?;
        let write_side = stream.try_clone().map_err(WireError::from)?;
        Ok(L3Client {
            conn: Mutex::new(Conn {
                reader: BufReader::new(stream),
                writer: BufWriter::new(write_side),
            }),
        })
    }

    fn conn(&self) -> MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn call(&self, op: Op, parts: &[&[u8]]) -> Result<(Status, Vec<u8>), L3ClientError> {
        let mut c = self.conn();
        write_frame(&mut c.writer, op as u8, parts)?;
        let (code, body) = read_frame(&mut c.reader)?
            .ok_or_else(|| L3ClientError::Protocol("connection closed".into()))?;
        match Status::try_from(code)? {
            Status::Error => Err(L3ClientError::Server(
                String::from_utf8_lossy(&body).into_owned(),
            )),
            status => Ok((status, body)),
        }
    }

    /// Stores an object; `true` if written, `false` if it was already present.
    ///
    /// # Errors
    /// [`L3ClientError`].
    pub fn put(&self, key: &ObjectKey, data: &[u8]) -> Result<bool, L3ClientError> {
        let k = serde_json::to_vec(key).map_err(|e| L3ClientError::Protocol(e.to_string()))?;
        let klen =
            u16::try_from(k.len()).map_err(|_| L3ClientError::Protocol("key too long".into()))?;
        match self.call(Op::Put, &[&klen.to_le_bytes(), &k, data])? {
            (Status::Ok, b) if b == [1] => Ok(true),
            (Status::Ok, b) if b == [0] => Ok(false),
            (s, _) => Err(L3ClientError::Protocol(format!("PUT answered {s:?}"))),
        }
    }

    /// The object's bytes, or `None` on a miss.
    ///
    /// # Errors
    /// [`L3ClientError`].
    pub fn get(&self, key: &ObjectKey) -> Result<Option<Vec<u8>>, L3ClientError> {
        let k = serde_json::to_vec(key).map_err(|e| L3ClientError::Protocol(e.to_string()))?;
        match self.call(Op::Get, &[&k])? {
            (Status::Ok, b) => Ok(Some(b)),
            (Status::Miss, _) => Ok(None),
            (s, _) => Err(L3ClientError::Protocol(format!("GET answered {s:?}"))),
        }
    }

    /// The number of leading `keys` present.
    ///
    /// # Errors
    /// [`L3ClientError`].
    pub fn lookup(&self, keys: &[ObjectKey]) -> Result<usize, L3ClientError> {
        let body = serde_json::to_vec(keys).map_err(|e| L3ClientError::Protocol(e.to_string()))?;
        match self.call(Op::Lookup, &[&body])? {
            (Status::Ok, b) if b.len() == 8 => {
                let mut n = [0u8; 8];
                n.copy_from_slice(&b);
                usize::try_from(u64::from_le_bytes(n))
                    .map_err(|_| L3ClientError::Protocol("lookup count overflows".into()))
            }
            (s, _) => Err(L3ClientError::Protocol(format!("LOOKUP answered {s:?}"))),
        }
    }

    /// Up to `limit` keys of `pool` written by `shard`, most recently used first ([`Op::Hot`]).
    ///
    /// # Errors
    /// [`L3ClientError`].
    pub fn hot(
        &self,
        shard: super::manifest::ShardCoords,
        pool: crate::memory::pool::PoolRole,
        limit: usize,
    ) -> Result<Vec<ObjectKey>, L3ClientError> {
        let q = super::server::HotQuery { shard, pool, limit };
        let body = serde_json::to_vec(&q).map_err(|e| L3ClientError::Protocol(e.to_string()))?;
        match self.call(Op::Hot, &[&body])? {
            (Status::Ok, b) => serde_json::from_slice(&b)
                .map_err(|e| L3ClientError::Protocol(format!("hot keys: {e}"))),
            (s, _) => Err(L3ClientError::Protocol(format!("HOT answered {s:?}"))),
        }
    }

    /// The replica's health report.
    ///
    /// # Errors
    /// [`L3ClientError`].
    pub fn health(&self) -> Result<L3Health, L3ClientError> {
        match self.call(Op::Health, &[])? {
            (Status::Ok, b) => serde_json::from_slice(&b)
                .map_err(|e| L3ClientError::Protocol(format!("health JSON: {e}"))),
            (s, _) => Err(L3ClientError::Protocol(format!("HEALTH answered {s:?}"))),
        }
    }
}

impl L3Backend for L3Client {
    type Error = L3ClientError;

    fn leading_present(&self, keys: &[ObjectKey]) -> Result<usize, L3ClientError> {
        self.lookup(keys)
    }

    fn put(&self, key: ObjectKey, data: &[u8]) -> Result<(), L3ClientError> {
        L3Client::put(self, &key, data).map(|_| ())
    }
}
