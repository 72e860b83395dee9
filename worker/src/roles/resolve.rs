//! Name resolution of peer Services (worker/interfaces/README.md §2): when `$TANDEM_HOSTS_FILE` is
//! set, that file alone (hosts(5) format, re-read on every lookup because the e2e runner rewrites
//! it as endpoints change); otherwise the system resolver. A name may appear on several lines:
//! every address is returned (a headless or emulated ClusterIP Service resolves to its ready pods).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

/// Environment variable naming the hosts file.
pub const HOSTS_FILE_ENV: &str = "TANDEM_HOSTS_FILE";

/// A lookup that failed.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The hosts file could not be read.
    #[error("hosts file {path}: {source}")]
    HostsFile {
        /// The file.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The system resolver failed.
    #[error("resolving {name}: {source}")]
    Dns {
        /// The name.
        name: String,
        /// Resolver error.
        source: std::io::Error,
    },
}

/// Addresses of `name` in hosts(5) text: every line whose name list contains `name`
/// (case-insensitive), in file order, without duplicates. Comments (`#`), blank lines and lines
/// whose first field is not an IP address are skipped.
pub fn parse_hosts(text: &str, name: &str) -> Vec<IpAddr> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("");
        let mut fields = line.split_whitespace();
        let Some(ip) = fields.next().and_then(|f| f.parse::<IpAddr>().ok()) else {
            continue;
        };
        if fields.any(|n| n.eq_ignore_ascii_case(name)) && seen.insert(ip) {
            out.push(ip);
        }
    }
    out
}

/// Where names are resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolver {
    /// A hosts file, re-read per lookup.
    HostsFile(PathBuf),
    /// The system resolver.
    System,
}

impl Resolver {
    /// [`Resolver::HostsFile`] when `$TANDEM_HOSTS_FILE` is set and non-empty, else the system.
    pub fn from_env() -> Self {
        match std::env::var_os(HOSTS_FILE_ENV) {
            Some(p) if !p.is_empty() => Resolver::HostsFile(PathBuf::from(p)),
            _ => Resolver::System,
        }
    }

    /// Socket addresses of `name` at `port`, sorted (a stable order for spreading).
    ///
    /// # Errors
    /// [`ResolveError`] when the file is unreadable or the resolver fails; a name with no address
    /// is `Ok(vec![])`.
    pub async fn lookup(&self, name: &str, port: u16) -> Result<Vec<SocketAddr>, ResolveError> {
        let mut addrs: Vec<SocketAddr> = match self {
            Resolver::HostsFile(path) => read_hosts(path)
                .await?
                .map(|text| parse_hosts(&text, name))
                .unwrap_or_default()
                .into_iter()
                .map(|ip| SocketAddr::new(ip, port))
                .collect(),
            Resolver::System => match tokio::net::lookup_host((name, port)).await {
                Ok(it) => it.collect(),
                Err(e) => {
                    // NXDOMAIN of a Service with no ready endpoint is "no peers", not an error.
                    tracing::debug!(name, error = %e, "DNS lookup failed");
                    return Err(ResolveError::Dns {
                        name: name.to_owned(),
                        source: e,
                    });
                }
            },
        };
        addrs.sort();
        addrs.dedup();
        Ok(addrs)
    }
}

impl Resolver {
    /// [`Resolver::lookup`] for blocking contexts (the L3 client runs on the blocking pool).
    ///
    /// # Errors
    /// As [`Resolver::lookup`].
    pub fn lookup_blocking(&self, name: &str, port: u16) -> Result<Vec<SocketAddr>, ResolveError> {
        use std::net::ToSocketAddrs;
        let mut addrs: Vec<SocketAddr> = match self {
            Resolver::HostsFile(path) => match std::fs::read_to_string(path) {
                Ok(text) => parse_hosts(&text, name)
                    .into_iter()
                    .map(|ip| SocketAddr::new(ip, port))
                    .collect(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(source) => {
                    return Err(ResolveError::HostsFile {
                        path: path.clone(),
                        source,
                    });
                }
            },
            Resolver::System => (name, port)
                .to_socket_addrs()
                .map_err(|source| ResolveError::Dns {
                    name: name.to_owned(),
                    source,
                })?
                .collect(),
        };
        addrs.sort();
        addrs.dedup();
        Ok(addrs)
    }
}

/// The file's text; `None` when it does not exist yet (the runner writes it after start).
async fn read_hosts(path: &Path) -> Result<Option<String>, ResolveError> {
    match tokio::fs::read_to_string(path).await {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ResolveError::HostsFile {
            path: path.to_path_buf(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOSTS: &str = "\
# emulated services
127.0.0.1 localhost
10.0.0.7 p-peers.ns.svc.cluster.local p-peers.ns.svc p-peers.ns
10.0.0.8\tp-peers.ns.svc.cluster.local   # second endpoint
not-an-ip p-peers.ns.svc.cluster.local
10.0.0.7 p-peers.ns.svc.cluster.local
fd00::9 P-PEERS.ns.svc.cluster.local
";

    #[test]
    fn every_line_of_a_name_counts_once() {
        let ips = parse_hosts(HOSTS, "p-peers.ns.svc.cluster.local");
        let want: Vec<IpAddr> = vec![
            "10.0.0.7".parse().unwrap(),
            "10.0.0.8".parse().unwrap(),
            "fd00::9".parse().unwrap(),
        ];
        assert_eq!(ips, want);
        assert_eq!(parse_hosts(HOSTS, "p-peers.ns").len(), 1);
        assert!(parse_hosts(HOSTS, "p-peers").is_empty());
        assert!(parse_hosts(HOSTS, "#").is_empty());
    }

    #[tokio::test]
    async fn the_file_is_re_read_on_every_lookup() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hosts");
        let r = Resolver::HostsFile(path.clone());
        // Missing file: no peers yet, not an error.
        assert!(r.lookup("svc", 7000).await.unwrap().is_empty());
        std::fs::write(&path, "127.0.0.3 svc\n127.0.0.2 svc\n").unwrap();
        let a = r.lookup("svc", 7000).await.unwrap();
        assert_eq!(
            a,
            vec![
                "127.0.0.2:7000".parse().unwrap(),
                "127.0.0.3:7000".parse().unwrap()
            ]
        );
        std::fs::write(&path, "127.0.0.3 svc\n").unwrap();
        assert_eq!(r.lookup("svc", 1).await.unwrap().len(), 1);
    }
}
