//! The L3 CacheTier store: objects on a data directory (a PVC in the cluster) with a memory tier in
//! front, LRU eviction within both budgets, and restart loadback (DESIGN contract 7, reference/
//! dataplane.md R-L3-1..5).
//!
//! Directory layout under `data_dir`:
//! - `objects/<stem>.kv` — object bytes;
//! - `manifests/<stem>.json` — the [`ObjectManifest`], the commit point of a put;
//! - `tmp/` — files being written; emptied at start;
//! - `quarantine/` — objects whose checksum, length or manifest was bad, kept for inspection;
//! - `stale/` — objects written under another [`StoreIdentity`] (model, layout, page size, parallel
//!   sizes), kept, never served (R-L3-3: marked, deleted later by the operator, not dropped at once).
//!
//! Put: data to `tmp/`, fsync, rename into `objects/`; then the manifest atomically into `manifests/`
//! ([`write_atomically`]). The object becomes visible to `get` only after the manifest is durable
//! (R-L3-4); while the put runs, `get` answers a miss. Objects are immutable (their key is a content
//! hash): a second put of a present key is acknowledged without a write.
//!
//! Open: `tmp/` is emptied and data files without a manifest (a crash between data write and
//! manifest commit) are deleted before serving starts; then [`L3Store::open`] returns and a loadback
//! thread verifies every manifest (format, identity, coordinates, length, checksum over the full
//! bytes) newest first and publishes each verified object while `get` and `put` already run. An object
//! not yet published is a miss, never a wait; a bad object is a counted miss, never a crash.
//!
//! Eviction: the disk tier is an LRU over published objects bounded by `disk_budget_bytes` (evicting
//! deletes the manifest first, so the object stops existing before its data goes); the memory tier is
//! an LRU of object bytes bounded by `memory_budget_bytes`. After a restart the LRU order is rebuilt
//! from commit times (recency of use before the restart is not persisted).

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lru::LruCache;
use serde::{Deserialize, Serialize};

use super::manifest::{
    MANIFEST_FORMAT, ObjectKey, ObjectManifest, ShardCoords, StoreIdentity, checksum, sync_dir,
    write_atomically,
};
use crate::memory::pool::PoolRole;

const OBJECTS: &str = "objects";
const MANIFESTS: &str = "manifests";
const TMP: &str = "tmp";
const QUARANTINE: &str = "quarantine";
const STALE: &str = "stale";
/// Read size of loadback and of disk gets.
const READ_CHUNK: usize = 8 << 20;
/// Objects ahead of the one being verified that loadback asks the kernel to read in advance
/// (`tandem-bench loadback` gives its baseline the same depth).
pub const READ_AHEAD_OBJECTS: usize = 4;

/// Objects read and waiting for the verifier during loadback (each holds one object's bytes).
const LOADBACK_PIPELINE_DEPTH: usize = 2;

/// Configuration of one store replica.
#[derive(Debug, Clone)]
pub struct L3Config {
    /// Data directory (created if missing).
    pub data_dir: PathBuf,
    /// What every object must agree on.
    pub identity: StoreIdentity,
    /// Bytes of object data kept in memory.
    pub memory_budget_bytes: u64,
    /// Bytes of object data kept on disk (manifests not counted).
    pub disk_budget_bytes: u64,
    /// Interval of the loadback progress log line.
    pub progress_interval: Duration,
    /// fsync data, manifests and directories on put (the default). Off only in tests that write
    /// thousands of objects: atomicity (temp + rename) is kept, durability against power loss is not.
    pub fsync: bool,
}

impl L3Config {
    /// A configuration with fsync on and a progress line every 5 s.
    pub fn new(
        data_dir: PathBuf,
        identity: StoreIdentity,
        memory_budget_bytes: u64,
        disk_budget_bytes: u64,
    ) -> Self {
        L3Config {
            data_dir,
            identity,
            memory_budget_bytes,
            disk_budget_bytes,
            progress_interval: Duration::from_secs(5),
            fsync: true,
        }
    }
}

/// Errors of the store. None of them is raised for a bad object on disk: those are misses.
#[derive(Debug, thiserror::Error)]
pub enum L3Error {
    /// An I/O step of a put or of opening the data directory failed.
    #[error("L3 store I/O at {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// A put's key does not fit the store identity (rank or layer range out of range).
    #[error("object {0} does not fit the store identity (ranks or layer range)")]
    KeyOutOfIdentity(ObjectKey),
    /// A put is larger than the disk budget, so it could never be kept.
    #[error("object of {len} bytes exceeds the disk budget of {budget} bytes")]
    TooLarge {
        /// Object bytes.
        len: u64,
        /// Disk budget.
        budget: u64,
    },
    /// The same key is being put concurrently; the first put decides.
    #[error("object {0} is already being written")]
    PutInFlight(ObjectKey),
    /// The volume is full (no space, quota exceeded, or the file size limit hit) while writing the
    /// object: the put is refused and counted in [`L3Counters::puts_refused_disk_full`], whatever it
    /// had written is removed (nothing half-written stays, in this process or after a restart), and
    /// the store keeps serving reads.
    #[error("L3 store volume full at {path}: {source}")]
    DiskFull {
        /// The file being written.
        path: PathBuf,
        /// The OS error (`StorageFull`, `QuotaExceeded` or `FileTooLarge`).
        source: io::Error,
    },
    /// A manifest could not be encoded (never expected: plain serde types).
    #[error("encoding manifest: {0}")]
    Encode(#[from] serde_json::Error),
}

/// Whether an I/O error means the volume (or the process's file size limit) is full.
fn volume_full(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded | io::ErrorKind::FileTooLarge
    )
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> L3Error + '_ {
    move |source| L3Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// What a put did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// The object was written and is now visible.
    Stored,
    /// The key was already present; nothing was written.
    AlreadyPresent,
}

/// Warmth of the store, reported in its health (`CacheWarm` is what the operator turns into the
/// CacheTier condition).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WarmState {
    /// Loadback is still verifying objects found on disk; gets of those answer misses.
    Warming,
    /// Loadback is done: everything valid on disk is published.
    CacheWarm,
}

/// Loadback progress.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadbackProgress {
    /// Manifests found at open.
    pub total: u64,
    /// Manifests examined so far.
    pub scanned: u64,
    /// Objects verified and published.
    pub published: u64,
    /// Bytes read and verified.
    pub bytes_verified: u64,
    /// Objects moved to `quarantine/`: unreadable manifest, missing data, wrong length or checksum.
    pub corrupt: u64,
    /// Objects moved to `stale/`: another identity or manifest format.
    pub identity_mismatch: u64,
    /// Data files without a manifest deleted at open (puts cut by a crash).
    pub orphans_removed: u64,
    /// Seconds since open.
    pub elapsed_s: f64,
    /// `bytes_verified / elapsed_s`.
    pub bytes_per_s: f64,
}

/// Counters of the serving path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct L3Counters {
    /// Gets answered from memory.
    pub hits_memory: u64,
    /// Gets answered from disk.
    pub hits_disk: u64,
    /// Gets of unknown keys (including keys whose put or loadback is not finished).
    pub misses: u64,
    /// Misses answered while warming.
    pub misses_while_warming: u64,
    /// Disk reads that failed verification at get time (quarantined, answered as misses).
    pub corrupt_on_read: u64,
    /// Puts that wrote an object.
    pub puts: u64,
    /// Objects evicted from disk.
    pub evicted_disk: u64,
    /// Objects evicted from memory.
    pub evicted_memory: u64,
    /// Puts refused because the volume was full ([`L3Error::DiskFull`]).
    #[serde(default)]
    pub puts_refused_disk_full: u64,
    /// Puts that failed on another I/O error (their partial files removed too).
    #[serde(default)]
    pub puts_failed_io: u64,
}

/// The health report of a store replica.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct L3Health {
    /// `Warming` or `CacheWarm`.
    pub state: WarmState,
    /// Published objects.
    pub objects: u64,
    /// Bytes of published objects on disk.
    pub disk_bytes: u64,
    /// Bytes held in memory.
    pub memory_bytes: u64,
    /// Loadback progress.
    pub loadback: LoadbackProgress,
    /// Serving counters.
    pub counters: L3Counters,
    /// The volume is full now: the latest put that wrote to disk was refused with
    /// [`L3Error::DiskFull`] and no put has been stored since (issue 18 item 5; the cache role
    /// reports it as a degradation, the operator as the CacheTier's `Degraded` condition). The
    /// message names the file and the OS error of that refusal. Absent on the wire when `None`
    /// (and in documents of replicas that predate it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_full: Option<String>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    len: u64,
    checksum: u64,
}

struct State {
    /// Published objects (the disk LRU).
    disk: LruCache<ObjectKey, Entry>,
    disk_bytes: u64,
    memory: LruCache<ObjectKey, Arc<[u8]>>,
    memory_bytes: u64,
    writing: HashSet<ObjectKey>,
    counters: L3Counters,
    progress: LoadbackProgress,
    /// See [`L3Health::volume_full`].
    volume_full: Option<String>,
}

/// One store replica (see the module docs). Shared between serving threads behind an `Arc`.
pub struct L3Store {
    config: L3Config,
    objects_dir: PathBuf,
    manifests_dir: PathBuf,
    tmp_dir: PathBuf,
    state: Mutex<State>,
    warm: AtomicBool,
    stopping: AtomicBool,
    opened: Instant,
}

/// The loadback thread of a freshly opened store.
pub struct Loadback {
    handle: JoinHandle<()>,
}

impl Loadback {
    /// Waits for loadback to finish (the store is then `CacheWarm`).
    pub fn join(self) {
        let _ = self.join_checked();
    }

    /// [`Self::join`], telling whether the thread had panicked.
    ///
    /// # Errors
    /// The loadback thread panicked (a bug; the store stayed `Warming` and served misses).
    pub fn join_checked(self) -> Result<(), String> {
        if self.handle.join().is_err() {
            tracing::error!("L3 loadback thread panicked; store stays Warming");
            return Err("the loadback thread panicked".into());
        }
        Ok(())
    }
}

impl L3Store {
    /// Opens (or creates) the store in `config.data_dir`: empties `tmp/`, deletes data files that
    /// have no manifest, lists the manifests, and starts the loadback thread that verifies and
    /// publishes them. The store serves as soon as this returns.
    ///
    /// # Errors
    /// [`L3Error::Io`] when the directories cannot be created or listed. A bad object is never an
    /// error here.
    pub fn open(config: L3Config) -> Result<(Arc<L3Store>, Loadback), L3Error> {
        let root = config.data_dir.clone();
        let dir = |name: &str| root.join(name);
        for name in [OBJECTS, MANIFESTS, TMP, QUARANTINE, STALE] {
            fs::create_dir_all(dir(name)).map_err(io_at(&dir(name)))?;
        }
        let tmp_dir = dir(TMP);
        for entry in fs::read_dir(&tmp_dir).map_err(io_at(&tmp_dir))? {
            let path = entry.map_err(io_at(&tmp_dir))?.path();
            remove_quietly(&path);
        }
        let manifests_dir = dir(MANIFESTS);
        let mut manifests = Vec::new();
        let mut stems = HashSet::new();
        for entry in fs::read_dir(&manifests_dir).map_err(io_at(&manifests_dir))? {
            let path = entry.map_err(io_at(&manifests_dir))?.path();
            if let Some(stem) = stem_with_ext(&path, "json") {
                stems.insert(stem);
                manifests.push(path);
            }
        }
        let objects_dir = dir(OBJECTS);
        let mut orphans = 0;
        for entry in fs::read_dir(&objects_dir).map_err(io_at(&objects_dir))? {
            let path = entry.map_err(io_at(&objects_dir))?.path();
            let known = stem_with_ext(&path, "kv").is_some_and(|s| stems.contains(&s));
            if !known {
                tracing::warn!(path = %path.display(), "removing L3 data file without manifest");
                remove_quietly(&path);
                orphans += 1;
            }
        }
        if orphans > 0 {
            sync_dir(&objects_dir).map_err(io_at(&objects_dir))?;
        }
        let store = Arc::new(L3Store {
            objects_dir,
            manifests_dir,
            tmp_dir,
            state: Mutex::new(State {
                disk: LruCache::unbounded(),
                disk_bytes: 0,
                memory: LruCache::unbounded(),
                memory_bytes: 0,
                writing: HashSet::new(),
                counters: L3Counters::default(),
                progress: LoadbackProgress {
                    total: manifests.len() as u64,
                    orphans_removed: orphans,
                    ..LoadbackProgress::default()
                },
                volume_full: None,
            }),
            warm: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            opened: Instant::now(),
            config,
        });
        let worker = Arc::clone(&store);
        let handle = std::thread::Builder::new()
            .name("l3-loadback".into())
            .spawn(move || worker.run_loadback(manifests))
            .map_err(io_at(&root))?;
        Ok((store, Loadback { handle }))
    }

    /// The store identity.
    pub fn identity(&self) -> &StoreIdentity {
        &self.config.identity
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state has no invariant a panicking holder could break half-way that matters more than
        // serving: recover the guard.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn object_path(&self, key: &ObjectKey) -> PathBuf {
        self.objects_dir.join(format!("{}.kv", key.file_stem()))
    }

    fn manifest_path(&self, key: &ObjectKey) -> PathBuf {
        self.manifests_dir.join(format!("{}.json", key.file_stem()))
    }

    /// Asks loadback to stop after the object it is verifying (teardown, DESIGN contract 9); join
    /// [`Loadback`] afterwards. The store keeps serving what is published. Nothing on disk changes:
    /// the next start loads the rest.
    pub fn stop_loadback(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Makes the directory entries of every acknowledged put durable: fsyncs `objects/` and
    /// `manifests/` (teardown, DESIGN contract 9). With `fsync` on each put already did; with it
    /// off (tests only) this is where renames become durable.
    ///
    /// # Errors
    /// The I/O error of a directory's open or fsync, naming it.
    pub fn sync(&self) -> io::Result<()> {
        for dir in [&self.objects_dir, &self.manifests_dir] {
            super::manifest::sync_dir(dir)
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.display())))?;
        }
        Ok(())
    }

    /// Whether loadback has finished.
    pub fn is_warm(&self) -> bool {
        self.warm.load(Ordering::Acquire)
    }

    /// Whether `key` is published (a get would hit).
    pub fn contains(&self, key: &ObjectKey) -> bool {
        self.lock().disk.contains(key)
    }

    /// The number of leading `keys` that are published: the L3 part of a prefix lookup
    /// (reference: HiCache `batch_exists` returns the count of consecutive leading hits).
    pub fn leading_present(&self, keys: &[ObjectKey]) -> usize {
        let state = self.lock();
        keys.iter().take_while(|k| state.disk.contains(k)).count()
    }

    /// Up to `limit` published keys of `pool` written by `shard`, most recently used first
    /// (without touching their recency): what a restarted worker loads back into its host cache.
    pub fn hot_keys(&self, shard: ShardCoords, pool: PoolRole, limit: usize) -> Vec<ObjectKey> {
        let state = self.lock();
        state
            .disk
            .iter()
            .map(|(k, _)| *k)
            .filter(|k| k.shard == shard && k.pool == pool)
            .take(limit)
            .collect()
    }

    /// Stores `data` under `key`; visible to `get` only once durable (see the module docs).
    ///
    /// # Errors
    /// [`L3Error::KeyOutOfIdentity`], [`L3Error::TooLarge`], [`L3Error::PutInFlight`], or
    /// [`L3Error::Io`] of a write step (the object then stays invisible).
    pub fn put(&self, key: ObjectKey, data: &[u8]) -> Result<PutOutcome, L3Error> {
        self.put_inner(key, data, PutFault::None)
    }

    /// Test hook: a put that stops after the data file is durable and before the manifest commit,
    /// as a crash there would (reference TC-L3-01). The object must never become visible.
    #[doc(hidden)]
    pub fn put_crashing_before_manifest(&self, key: ObjectKey, data: &[u8]) -> Result<(), L3Error> {
        self.put_inner(key, data, PutFault::CrashBeforeManifest)
            .map(|_| ())
    }

    fn put_inner(
        &self,
        key: ObjectKey,
        data: &[u8],
        fault: PutFault,
    ) -> Result<PutOutcome, L3Error> {
        if !key.shard.fits(&self.config.identity) {
            return Err(L3Error::KeyOutOfIdentity(key));
        }
        let len = data.len() as u64;
        if len > self.config.disk_budget_bytes {
            return Err(L3Error::TooLarge {
                len,
                budget: self.config.disk_budget_bytes,
            });
        }
        {
            let mut state = self.lock();
            if state.disk.contains(&key) {
                state.disk.promote(&key);
                return Ok(PutOutcome::AlreadyPresent);
            }
            if !state.writing.insert(key) {
                return Err(L3Error::PutInFlight(key));
            }
        }
        let written = self.write_object(&key, data, fault);
        if written.is_err() {
            // Nothing of a failed put may stay: manifest first (the object stops existing), then
            // data, then the temporaries. The key is not published, so none of these is a live
            // object's file.
            remove_quietly(&self.manifest_path(&key));
            remove_quietly(&self.object_path(&key));
            let stem = key.file_stem();
            remove_quietly(&self.tmp_dir.join(format!("{stem}.kv.tmp")));
            remove_quietly(&self.tmp_dir.join(format!("{stem}.json.tmp")));
        }
        let mut state = self.lock();
        state.writing.remove(&key);
        let manifest = match written {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(PutOutcome::Stored), // simulated crash: nothing published
            Err(L3Error::Io { path, source }) if volume_full(&source) => {
                state.counters.puts_refused_disk_full += 1;
                state.volume_full = Some(format!("{}: {source}", path.display()));
                drop(state);
                tracing::warn!(%key, path = %path.display(), error = %source,
                    "L3 volume full: put refused");
                return Err(L3Error::DiskFull { path, source });
            }
            Err(e) => {
                state.counters.puts_failed_io += 1;
                return Err(e);
            }
        };
        state.counters.puts += 1;
        state.volume_full = None;
        let victims = self.publish(&mut state, key, manifest.length, manifest.checksum, false);
        self.admit_memory(&mut state, key, Arc::from(data), false);
        drop(state);
        self.delete_victims(&victims);
        Ok(PutOutcome::Stored)
    }

    fn write_object(
        &self,
        key: &ObjectKey,
        data: &[u8],
        fault: PutFault,
    ) -> Result<Option<ObjectManifest>, L3Error> {
        let stem = key.file_stem();
        let tmp = self.tmp_dir.join(format!("{stem}.kv.tmp"));
        {
            let mut f = File::create(&tmp).map_err(io_at(&tmp))?;
            f.write_all(data).map_err(io_at(&tmp))?;
            if self.config.fsync {
                f.sync_all().map_err(io_at(&tmp))?;
            }
        }
        let obj = self.object_path(key);
        fs::rename(&tmp, &obj).map_err(io_at(&obj))?;
        if self.config.fsync {
            sync_dir(&self.objects_dir).map_err(io_at(&self.objects_dir))?;
        }
        if fault == PutFault::CrashBeforeManifest {
            return Ok(None);
        }
        let manifest = ObjectManifest {
            format: MANIFEST_FORMAT,
            key: *key,
            identity: self.config.identity.clone(),
            length: data.len() as u64,
            checksum: checksum(data),
            committed_unix_ns: unix_ns(),
        };
        let json = serde_json::to_vec(&manifest)?;
        write_atomically(
            &self.tmp_dir,
            &self.manifests_dir,
            &format!("{stem}.json"),
            &json,
            self.config.fsync,
        )
        .map_err(io_at(&self.manifest_path(key)))?;
        Ok(Some(manifest))
    }

    /// Inserts a published object into the disk LRU (as most recent, or as least recent for
    /// loadback, which goes newest first) and returns the objects evicted to respect the disk budget.
    fn publish(
        &self,
        state: &mut State,
        key: ObjectKey,
        len: u64,
        checksum: u64,
        as_oldest: bool,
    ) -> Vec<ObjectKey> {
        if let Some(old) = state.disk.put(key, Entry { len, checksum }) {
            state.disk_bytes -= old.len;
        }
        state.disk_bytes += len;
        if as_oldest {
            state.disk.demote(&key);
        }
        let mut victims = Vec::new();
        while state.disk_bytes > self.config.disk_budget_bytes {
            let Some((victim, entry)) = state.disk.pop_lru() else {
                break;
            };
            state.disk_bytes -= entry.len;
            state.counters.evicted_disk += 1;
            if let Some(bytes) = state.memory.pop(&victim) {
                state.memory_bytes -= bytes.len() as u64;
            }
            victims.push(victim);
        }
        victims
    }

    /// Keeps `data` in memory if it fits the budget; `only_if_room` (loadback) never evicts.
    fn admit_memory(&self, state: &mut State, key: ObjectKey, data: Arc<[u8]>, only_if_room: bool) {
        let len = data.len() as u64;
        let budget = self.config.memory_budget_bytes;
        if len > budget || !state.disk.contains(&key) {
            return;
        }
        if only_if_room && state.memory_bytes + len > budget {
            return;
        }
        if let Some(old) = state.memory.put(key, data) {
            state.memory_bytes -= old.len() as u64;
        }
        state.memory_bytes += len;
        while state.memory_bytes > budget {
            let Some((_, bytes)) = state.memory.pop_lru() else {
                break;
            };
            state.memory_bytes -= bytes.len() as u64;
            state.counters.evicted_memory += 1;
        }
    }

    /// Deletes evicted objects: manifest first (the object stops existing), then data.
    fn delete_victims(&self, victims: &[ObjectKey]) {
        for key in victims {
            remove_quietly(&self.manifest_path(key));
            remove_quietly(&self.object_path(key));
        }
    }

    /// The bytes of `key`, or `None` (a miss) if it is not published, or its data fails verification
    /// (then it is quarantined and counted). Never blocks on loadback.
    pub fn get(&self, key: &ObjectKey) -> Option<Arc<[u8]>> {
        let entry = {
            let mut state = self.lock();
            if let Some(bytes) = state.memory.get(key).cloned() {
                state.disk.promote(key);
                state.counters.hits_memory += 1;
                return Some(bytes);
            }
            match state.disk.get(key).copied() {
                Some(e) => e,
                None => {
                    state.counters.misses += 1;
                    if !self.is_warm() {
                        state.counters.misses_while_warming += 1;
                    }
                    return None;
                }
            }
        };
        let mut buf = Vec::new();
        match read_verified(&self.object_path(key), entry.len, entry.checksum, &mut buf) {
            Ok(()) => {
                let bytes: Arc<[u8]> = Arc::from(buf);
                let mut state = self.lock();
                state.counters.hits_disk += 1;
                self.admit_memory(&mut state, *key, Arc::clone(&bytes), false);
                Some(bytes)
            }
            Err(ReadError::Missing) => {
                // Evicted between the lookup and the read: a plain miss.
                let mut state = self.lock();
                state.counters.misses += 1;
                None
            }
            Err(ReadError::Bad(reason)) => {
                tracing::warn!(object = %key, %reason, "L3 object failed verification on read");
                let mut state = self.lock();
                if let Some(e) = state.disk.pop(key) {
                    state.disk_bytes -= e.len;
                }
                state.counters.corrupt_on_read += 1;
                state.counters.misses += 1;
                drop(state);
                self.move_aside(key, QUARANTINE);
                None
            }
        }
    }

    /// The health report.
    pub fn health(&self) -> L3Health {
        let state = self.lock();
        let mut loadback = state.progress;
        if !self.is_warm() {
            loadback.elapsed_s = self.opened.elapsed().as_secs_f64();
            loadback.bytes_per_s = rate(loadback.bytes_verified, loadback.elapsed_s);
        }
        L3Health {
            state: if self.is_warm() {
                WarmState::CacheWarm
            } else {
                WarmState::Warming
            },
            objects: state.disk.len() as u64,
            disk_bytes: state.disk_bytes,
            memory_bytes: state.memory_bytes,
            loadback,
            counters: state.counters,
            volume_full: state.volume_full.clone(),
        }
    }

    /// Moves an object's manifest and data into `quarantine/` or `stale/` (best effort: a failure
    /// is logged, the object is unpublished either way).
    fn move_aside(&self, key: &ObjectKey, to: &str) {
        self.move_files_aside(&self.manifest_path(key), &self.object_path(key), to);
    }

    fn move_files_aside(&self, manifest: &Path, data: &Path, to: &str) {
        let dest = self.config.data_dir.join(to);
        // Data first: a manifest left behind without data is quarantined again next start.
        for path in [data, manifest] {
            if let Some(name) = path.file_name()
                && path.exists()
                && let Err(e) = fs::rename(path, dest.join(name))
            {
                tracing::warn!(path = %path.display(), error = %e, "could not move L3 file aside");
            }
        }
    }

    fn run_loadback(self: Arc<Self>, manifest_paths: Vec<PathBuf>) {
        let mut candidates = Vec::with_capacity(manifest_paths.len());
        // Queue every manifest read at once instead of paying one disk round trip per manifest.
        for path in &manifest_paths {
            hint_will_need(path);
        }
        for path in manifest_paths {
            match read_manifest(&path) {
                Ok(m) => candidates.push((path, m)),
                Err(reason) => {
                    tracing::warn!(path = %path.display(), %reason, "unreadable L3 manifest");
                    let data = stem_with_ext(&path, "json")
                        .map(|s| self.objects_dir.join(format!("{s}.kv")))
                        .unwrap_or_default();
                    self.move_files_aside(&path, &data, QUARANTINE);
                    let mut state = self.lock();
                    state.progress.scanned += 1;
                    state.progress.corrupt += 1;
                }
            }
        }
        // Newest first: the hottest data becomes visible first; each is demoted so that the final
        // LRU order is oldest-least-recent, behind any put made while loading.
        candidates.sort_by_key(|(_, m)| std::cmp::Reverse(m.committed_unix_ns));
        // Two stages, so that the disk never waits for the hash (issue 16: loadback was 0.79 × the
        // disk's sequential read with both on one thread): this thread reads objects into buffers
        // that a verifier thread hashes and publishes, in the same (newest-first) order.
        let (loaded_tx, loaded_rx) = mpsc::sync_channel::<Loaded>(LOADBACK_PIPELINE_DEPTH);
        let (free_tx, free_rx) = mpsc::channel::<Vec<u8>>();
        let stopped = std::thread::scope(|s| {
            let verifier = s.spawn(|| self.verify_and_publish(loaded_rx, free_tx));
            let data_paths: Vec<PathBuf> = candidates
                .iter()
                .map(|(_, m)| self.object_path(&m.key))
                .collect();
            let mut stopped = false;
            for (i, (path, manifest)) in candidates.into_iter().enumerate() {
                // Keep the disk busy ahead of this read: ask the kernel for the next objects.
                for next in data_paths.iter().skip(i + 1).take(READ_AHEAD_OBJECTS) {
                    hint_will_need(next);
                }
                if self.stopping.load(Ordering::Acquire) {
                    stopped = true;
                    break;
                }
                // A recycled buffer once the pipeline is full; a new one until then.
                let mut buf = free_rx.try_recv().unwrap_or_default();
                let read = self.read_candidate(&path, &manifest, &mut buf);
                let item = Loaded {
                    manifest,
                    buf,
                    read,
                };
                if loaded_tx.send(item).is_err() {
                    break; // the verifier is gone: it saw the stop flag
                }
            }
            drop(loaded_tx);
            let verifier_stopped = verifier.join().unwrap_or(true);
            stopped || verifier_stopped
        });
        if stopped {
            self.log_progress("L3 loadback stopped by shutdown; the rest loads at next start");
            return;
        }
        {
            let mut state = self.lock();
            state.progress.elapsed_s = self.opened.elapsed().as_secs_f64();
            state.progress.bytes_per_s =
                rate(state.progress.bytes_verified, state.progress.elapsed_s);
        }
        self.warm.store(true, Ordering::Release);
        self.log_progress("L3 loadback done: CacheWarm");
    }

    fn log_progress(&self, msg: &str) {
        let h = self.health();
        let p = h.loadback;
        tracing::info!(
            scanned = p.scanned,
            total = p.total,
            published = p.published,
            corrupt = p.corrupt,
            identity_mismatch = p.identity_mismatch,
            orphans_removed = p.orphans_removed,
            mib_per_s = p.bytes_per_s / f64::from(1 << 20),
            "{msg}"
        );
    }

    /// The reading stage of loadback: the manifest's own checks, then the object's bytes into
    /// `buf` (length checked). The checksum is the verifier's ([`Self::verify_and_publish`]).
    fn read_candidate(
        &self,
        path: &Path,
        m: &ObjectManifest,
        buf: &mut Vec<u8>,
    ) -> Result<(), Verdict> {
        if m.format != MANIFEST_FORMAT {
            return Err(Verdict::Stale(format!("manifest format {}", m.format)));
        }
        if m.identity != self.config.identity {
            return Err(Verdict::Stale("store identity differs".into()));
        }
        if !m.key.shard.fits(&self.config.identity) {
            return Err(Verdict::Stale("coordinates outside the identity".into()));
        }
        if stem_with_ext(path, "json").as_deref() != Some(m.key.file_stem().as_str()) {
            return Err(Verdict::Corrupt(
                "manifest file name does not match its key".into(),
            ));
        }
        match read_object(&self.object_path(&m.key), m.length, buf) {
            Ok(()) => Ok(()),
            Err(ReadError::Missing) => Err(Verdict::Corrupt("data file missing".into())),
            Err(ReadError::Bad(reason)) => Err(Verdict::Corrupt(reason)),
        }
    }

    /// The verifying stage of loadback: checksums each object read, publishes the good ones in
    /// arrival order (newest first), moves the others aside, and hands each buffer back on `free`.
    /// Returns true when it stopped early on [`Self::stop_loadback`].
    fn verify_and_publish(
        &self,
        loaded: mpsc::Receiver<Loaded>,
        free: mpsc::Sender<Vec<u8>>,
    ) -> bool {
        let mut last_log = Instant::now();
        for Loaded {
            manifest,
            buf,
            read,
        } in loaded
        {
            if self.stopping.load(Ordering::Acquire) {
                return true;
            }
            let verdict = match read {
                Err(v) => v,
                Ok(()) => match checksum(&buf) {
                    got if got == manifest.checksum => Verdict::Good,
                    got => Verdict::Corrupt(format!(
                        "checksum {got:016x}, manifest says {:016x}",
                        manifest.checksum
                    )),
                },
            };
            let mut state = self.lock();
            state.progress.scanned += 1;
            match verdict {
                Verdict::Good => {
                    state.progress.published += 1;
                    state.progress.bytes_verified += manifest.length;
                    let victims = if state.disk.contains(&manifest.key) {
                        Vec::new() // re-put while loading: already published
                    } else {
                        self.publish(
                            &mut state,
                            manifest.key,
                            manifest.length,
                            manifest.checksum,
                            true,
                        )
                    };
                    // Copy into memory only while the budget has room (newest first).
                    if state.memory_bytes + manifest.length <= self.config.memory_budget_bytes {
                        self.admit_memory(&mut state, manifest.key, Arc::from(&buf[..]), true);
                    }
                    drop(state);
                    self.delete_victims(&victims);
                }
                Verdict::Stale(reason) => {
                    state.progress.identity_mismatch += 1;
                    let first = state.progress.identity_mismatch == 1;
                    drop(state);
                    // A changed identity makes every object stale: one warning, then debug lines;
                    // the count is in the progress lines and the health report.
                    if first {
                        tracing::warn!(object = %manifest.key, %reason, "L3 objects of another identity found: moved to stale/, served as misses");
                    } else {
                        tracing::debug!(object = %manifest.key, %reason, "L3 object of another identity: stale");
                    }
                    self.move_aside(&manifest.key, STALE);
                }
                Verdict::Corrupt(reason) => {
                    state.progress.corrupt += 1;
                    drop(state);
                    tracing::warn!(object = %manifest.key, %reason, "L3 object failed verification: quarantined");
                    self.move_aside(&manifest.key, QUARANTINE);
                }
            }
            let _ = free.send(buf);
            if last_log.elapsed() >= self.config.progress_interval {
                last_log = Instant::now();
                self.log_progress("L3 loadback progress");
            }
        }
        false
    }
}

/// One object between loadback's reading and verifying stages.
struct Loaded {
    manifest: ObjectManifest,
    /// The object's bytes when `read` is `Ok`.
    buf: Vec<u8>,
    /// The reading stage's verdict when it already failed (stale or corrupt), else `Ok`.
    read: Result<(), Verdict>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PutFault {
    None,
    CrashBeforeManifest,
}

enum Verdict {
    /// Verified.
    Good,
    Stale(String),
    Corrupt(String),
}

fn read_manifest(path: &Path) -> Result<ObjectManifest, String> {
    let bytes = fs::read(path).map_err(|e| format!("read: {e}"))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("parse: {e}"))
}

enum ReadError {
    /// The data file does not exist (evicted concurrently, or lost).
    Missing,
    /// The data file is unreadable or does not match its manifest.
    Bad(String),
}

impl From<String> for ReadError {
    fn from(s: String) -> Self {
        ReadError::Bad(s)
    }
}

/// Reads a whole object into `buf` (resized to its length; reused across calls by loadback) and
/// checks its length and checksum; the error says what was wrong.
fn read_verified(path: &Path, len: u64, want: u64, buf: &mut Vec<u8>) -> Result<(), ReadError> {
    read_object(path, len, buf)?;
    let got = checksum(buf);
    if got != want {
        return Err(ReadError::Bad(format!(
            "checksum {got:016x}, manifest says {want:016x}"
        )));
    }
    Ok(())
}

/// Reads a whole object into `buf` (resized to its length) after checking the file's length
/// against the manifest's; the checksum is the caller's.
fn read_object(path: &Path, len: u64, buf: &mut Vec<u8>) -> Result<(), ReadError> {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ReadError::Missing),
        Err(e) => return Err(ReadError::Bad(format!("open: {e}"))),
    };
    let actual_len = f.metadata().map_err(|e| format!("stat: {e}"))?.len();
    if actual_len != len {
        return Err(ReadError::Bad(format!(
            "length {actual_len}, manifest says {len}"
        )));
    }
    let size = usize::try_from(len)
        .map_err(|_| ReadError::Bad("object larger than the address space".to_owned()))?;
    buf.resize(size, 0);
    let mut done = 0;
    while done < size {
        let end = (done + READ_CHUNK).min(size);
        f.read_exact(&mut buf[done..end])
            .map_err(|e| format!("read: {e}"))?;
        done = end;
    }
    Ok(())
}

/// Asks the kernel to start reading `path` into the page cache (`POSIX_FADV_WILLNEED`); a failure
/// only loses the overlap, so it is ignored.
fn hint_will_need(path: &Path) {
    if let Ok(f) = File::open(path) {
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fadvise on a descriptor we own for the duration of the call; no memory is
        // passed.
        let _ = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED) };
    }
}

fn stem_with_ext(path: &Path, ext: &str) -> Option<String> {
    if path.extension()? != ext {
        return None;
    }
    path.file_stem()?.to_str().map(str::to_owned)
}

fn remove_quietly(path: &Path) {
    if let Err(e) = fs::remove_file(path)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), error = %e, "could not remove L3 file");
    }
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn rate(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 { bytes as f64 / secs } else { 0.0 }
}
