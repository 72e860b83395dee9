//! L3 object identity and the per-object manifest, written atomically (DESIGN contract 7,
//! reference/dataplane.md R-L3-1).
//!
//! An object is one page of one pool over the layer range one (TP, CP) rank owns. Its manifest names
//! the object ([`ObjectKey`]), the store identity it was written under ([`StoreIdentity`]: model
//! identity and KV geometry, layout, page size, TP and CP sizes), its length and an xxh3-64 checksum of
//! its bytes. The manifest is the commit point of a put: it is written to a temporary file, fsynced and
//! renamed into place, and its directory fsynced, only after the data file is durable; an object without
//! a manifest does not exist.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::memory::pool::PoolRole;
use crate::tier::page_key::PageKey;

/// Manifest format version; a manifest of another version is a mismatch (a miss), never a crash.
pub const MANIFEST_FORMAT: u32 = 1;

/// What every object of one store must agree on; the cache-tier config names it
/// ([`CacheTierConfig::identity`](crate::config::CacheTierConfig::identity)), so it lives in
/// `tandem-interfaces` (worker/interfaces/README.md §2).
pub use tandem_interfaces::config::StoreIdentity;

/// Which rank's share of a page an object holds: the TP rank, and the CP rank with its owned layer
/// range `[layer_start, layer_end)` (DESIGN contract 6: L3 keys are per owned layer range, so two
/// ranks never write the same key; reference R-LS-3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardCoords {
    /// TP rank of the writer, `< tp_size`.
    pub tp_rank: u32,
    /// CP rank of the writer, `< cp_size`.
    pub cp_rank: u32,
    /// First owned layer.
    pub layer_start: u32,
    /// One past the last owned layer, `≤ layers`.
    pub layer_end: u32,
}

impl ShardCoords {
    /// All layers of `identity` on rank (0, 0): the replicated layout.
    pub fn whole(identity: &StoreIdentity) -> Self {
        ShardCoords {
            tp_rank: 0,
            cp_rank: 0,
            layer_start: 0,
            layer_end: identity.model.layers,
        }
    }

    /// Whether these coordinates exist under `identity`.
    pub fn fits(&self, identity: &StoreIdentity) -> bool {
        self.tp_rank < identity.tp_size
            && self.cp_rank < identity.cp_size
            && self.layer_start < self.layer_end
            && self.layer_end <= identity.model.layers
    }
}

/// The name of one L3 object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectKey {
    /// Chained page hash.
    pub page: PageKey,
    /// Pool the bytes belong to (target KV, draft KV, indexer).
    pub pool: PoolRole,
    /// Writer coordinates and layer range.
    pub shard: ShardCoords,
}

impl ObjectKey {
    /// File stem of the object: `<page>-<pool>-tp<r>-cp<r>-l<start>-<end>`; unique per key and made
    /// of `[0-9a-z-]` only.
    pub fn file_stem(&self) -> String {
        format!(
            "{}-{}-tp{}-cp{}-l{}-{}",
            self.page,
            self.pool,
            self.shard.tp_rank,
            self.shard.cp_rank,
            self.shard.layer_start,
            self.shard.layer_end
        )
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.file_stem())
    }
}

/// The manifest of one object (R-L3-1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectManifest {
    /// [`MANIFEST_FORMAT`].
    pub format: u32,
    /// The object.
    pub key: ObjectKey,
    /// The store identity it was written under.
    pub identity: StoreIdentity,
    /// Data length in bytes.
    pub length: u64,
    /// xxh3-64 of the data ([`checksum`]).
    pub checksum: u64,
    /// Commit time, ns since the Unix epoch; orders objects for LRU after a restart.
    pub committed_unix_ns: u64,
}

/// xxh3-64 of `data`, the object checksum.
pub fn checksum(data: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(data);
    h.digest()
}

/// Writes `bytes` to `dir/name` atomically: write `tmp_dir/name.tmp`, fsync it, rename it into `dir`,
/// fsync `dir`. A crash at any point leaves either no file or the complete file at `dir/name` (plus,
/// possibly, a temporary that the store removes at start). `tmp_dir` must be on the same file system.
/// `fsync` false skips both fsyncs (atomic, not durable: tests only).
///
/// # Errors
/// The I/O error of the failing step.
pub fn write_atomically(
    tmp_dir: &Path,
    dir: &Path,
    name: &str,
    bytes: &[u8],
    fsync: bool,
) -> io::Result<()> {
    let tmp = tmp_dir.join(format!("{name}.tmp"));
    {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        if fsync {
            f.sync_all()?;
        }
    }
    fs::rename(&tmp, dir.join(name))?;
    if fsync { sync_dir(dir) } else { Ok(()) }
}

/// fsyncs a directory so that renames and unlinks in it are durable.
///
/// # Errors
/// The I/O error of open or fsync.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::pool::PoolLayout;
    use crate::model::{Attention, ModelIdentity};

    fn identity() -> StoreIdentity {
        StoreIdentity {
            model: ModelIdentity {
                name: "tiny".into(),
                layers: 4,
                attention: Attention::Gqa {
                    kv_heads: 2,
                    head_dim: 8,
                },
                dtype_bytes: 2,
                row_extra_bytes: 0,
            },
            layout: PoolLayout::PageFirst,
            page_tokens: 16,
            tp_size: 2,
            cp_size: 1,
        }
    }

    #[test]
    fn manifest_round_trips_and_coords_are_checked() {
        let id = identity();
        let key = ObjectKey {
            page: PageKey::from_trace_id(7),
            pool: PoolRole::Indexer,
            shard: ShardCoords {
                tp_rank: 1,
                ..ShardCoords::whole(&id)
            },
        };
        assert_eq!(key.file_stem(), "0000000000000007-indexer-tp1-cp0-l0-4");
        let m = ObjectManifest {
            format: MANIFEST_FORMAT,
            key,
            identity: id.clone(),
            length: 3,
            checksum: checksum(b"abc"),
            committed_unix_ns: 1,
        };
        let json = serde_json::to_string(&m).expect("serialise");
        assert_eq!(serde_json::from_str::<ObjectManifest>(&json).ok(), Some(m));
        assert!(key.shard.fits(&id));
        let bad = ShardCoords {
            tp_rank: 2,
            ..key.shard
        };
        assert!(!bad.fits(&id));
    }

    #[test]
    fn atomic_write_leaves_the_complete_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        write_atomically(dir.path(), dir.path(), "m.json", b"{}", true).expect("write");
        assert_eq!(fs::read(dir.path().join("m.json")).expect("read"), b"{}");
        assert!(!dir.path().join("m.json.tmp").exists());
    }
}
