//! The resolved worker configuration: the one file a worker reads at start.
//!
//! The types — [`WorkerConfig`], [`CacheTierConfig`] and everything they embed — cross the
//! operator/worker boundary and live in `tandem-interfaces` (worker/interfaces/README.md §2); this
//! module re-exports them and adds what needs the file system and the environment: reading a config
//! file ([`LoadConfig`]) and `$TANDEM_ROOT` ([`resolve_path`]).

use std::path::Path;

pub use tandem_interfaces::config::*;

/// Reading a config file: the file's text through the type's `from_json` (parse and check).
pub trait LoadConfig: Sized {
    /// Reads, parses and checks a config file.
    ///
    /// # Errors
    /// [`ConfigError`]: unreadable, malformed, wrong version, or inconsistent.
    fn load(path: &Path) -> Result<Self, ConfigError>;
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })
}

impl LoadConfig for WorkerConfig {
    fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::from_json(&read(path)?, path)
    }
}

impl LoadConfig for CacheTierConfig {
    fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::from_json(&read(path)?, path)
    }
}

/// Resolves an absolute path a worker reads or writes through `$TANDEM_ROOT`
/// (worker/interfaces/README.md §2 and §5: the e2e process runner has no mount namespace): with
/// `TANDEM_ROOT=/tmp/r`, `/etc/tandem/worker.json` becomes `/tmp/r/etc/tandem/worker.json`.
/// Relative paths, and every path when the variable is unset or empty, are returned unchanged
/// ([`resolve_path_under`]).
pub fn resolve_path(path: &Path) -> std::path::PathBuf {
    resolve_path_under(
        std::env::var_os("TANDEM_ROOT").as_deref().map(Path::new),
        path,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The samples of worker/interfaces/README.md §2.
    fn sample(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("interfaces/samples")
            .join(name)
    }

    #[test]
    fn configs_load_from_files_through_the_checked_path() {
        let tier = CacheTierConfig::load(&sample("tier.json")).unwrap();
        assert_eq!(tier.data_dir, Path::new(DEFAULT_CACHE_DATA_DIR));
        let worker = WorkerConfig::load(&sample("decode-worker.json")).unwrap();
        assert_eq!(worker.memory.segment_bytes, 1_503_133_696);
        // Unreadable, malformed and unchecked files are typed errors naming the file.
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            CacheTierConfig::load(&dir.path().join("absent.json")),
            Err(ConfigError::Read { .. })
        ));
        let path = dir.path().join(CACHE_TIER_CONFIG_FILE);
        std::fs::write(&path, "{").unwrap();
        match CacheTierConfig::load(&path) {
            Err(ConfigError::Parse { path: p, .. }) => assert_eq!(p, path),
            other => panic!("want a parse error, got {other:?}"),
        }
        let mut v = serde_json::to_value(&tier).unwrap();
        v["memoryBytes"] = serde_json::json!(0);
        std::fs::write(&path, v.to_string()).unwrap();
        assert!(matches!(
            CacheTierConfig::load(&path),
            Err(ConfigError::Inconsistent(_))
        ));
        let wpath = dir.path().join(CONFIG_FILE);
        std::fs::write(&wpath, "{}").unwrap();
        assert!(matches!(
            WorkerConfig::load(&wpath),
            Err(ConfigError::Parse { .. })
        ));
    }

    /// Issue 14: beside an SGLang or vLLM engine the settings only the Simulated engine's path
    /// uses are refused, each named; the same config beside the Simulated engine (or none) loads.
    #[test]
    fn real_engines_refuse_the_settings_only_the_simulated_engine_uses() {
        let mut c = WorkerConfig::load(&sample("decode-worker.json")).unwrap();
        c.speculative = None;
        c.memory.segment_bytes -= c.memory.draft_pool_bytes;
        c.memory.draft_pool_bytes = 0;
        c.kv_deadline = Some(KvDeadline {
            milliseconds: 3_000,
            per_token_microseconds: 0,
        });
        c.parallelism.tensor = 2;
        for kind in [None, Some(EngineKind::Simulated)] {
            c.engine = kind.map(|kind| EngineSeat {
                kind,
                socket_dir: "/run/tandem/engine".into(),
                http_port: None,
            });
            c.check().unwrap();
        }
        // A decode without a cache hands requests over with the KV deadline; one serving the tier
        // calls (the sample has a cache) takes none.
        let (cache, mode) = (c.cache.clone(), c.memory.client_mode);
        for (kind, cached, named) in [
            (
                EngineKind::SgLang,
                true,
                "kvDeadline, parallelism above 1 set beside engine",
            ),
            (
                EngineKind::SgLang,
                false,
                "parallelism above 1 set beside engine",
            ),
            (
                EngineKind::Vllm,
                true,
                "kvDeadline, parallelism above 1 set beside engine",
            ),
            (
                EngineKind::Vllm,
                false,
                "parallelism above 1 set beside engine",
            ),
        ] {
            // memory.clientMode is set exactly when cache is.
            (c.cache, c.memory.client_mode) = if cached {
                (cache.clone(), mode)
            } else {
                (None, None)
            };
            c.engine = Some(EngineSeat {
                kind,
                socket_dir: "/run/tandem/engine".into(),
                http_port: None,
            });
            match c.check() {
                Err(ConfigError::Inconsistent(m)) => assert!(m.starts_with(named), "{m}"),
                other => panic!("{kind:?}: {other:?}"),
            }
        }
        c.kv_deadline = None;
        c.parallelism.tensor = 1;
        c.check().unwrap();
    }

    /// `kvDeadline` (seed 004's prefill queueing deadline): bounded and decode only (the decode
    /// role's reading of it is tested beside `roles::decode::kv_deadline_of`).
    #[test]
    fn the_kv_deadline_is_bounded_and_decode_only() {
        let mut c = WorkerConfig::load(&sample("decode-worker.json")).unwrap();
        c.kv_deadline = Some(KvDeadline {
            milliseconds: 3_000,
            per_token_microseconds: 50,
        });
        c.check().unwrap();
        for bad in [
            KvDeadline {
                milliseconds: 99,
                per_token_microseconds: 0,
            },
            KvDeadline {
                milliseconds: 600_001,
                per_token_microseconds: 0,
            },
            KvDeadline {
                milliseconds: 1_000,
                per_token_microseconds: 100_001,
            },
        ] {
            c.kv_deadline = Some(bad);
            assert!(
                matches!(c.check(), Err(ConfigError::Inconsistent(_))),
                "{bad:?}"
            );
        }
        c.kv_deadline = Some(KvDeadline {
            milliseconds: 3_000,
            per_token_microseconds: 0,
        });
        c.role = WorkerRole::Prefill;
        assert!(
            matches!(c.check(), Err(ConfigError::Inconsistent(m)) if m.contains("decode setting"))
        );
    }
}
