//! Unix socket addresses for paths longer than `sun_path` (108 bytes on Linux, including the NUL).
//!
//! The store-client socket lives on the pod's shared `/dev/shm` volume. In a container that path is
//! short, but wherever the volume's host path shows through — the e2e process runner resolves
//! `/dev/shm` under `$TANDEM_ROOT`, a kubelet-style pod directory with a UID in it — the path can
//! exceed `sun_path`, and `bind`/`connect` would fail with `ENAMETOOLONG`. A too-long path is
//! therefore addressed through its directory: the directory is opened (`O_PATH`) and the socket is
//! named `/proc/self/fd/<fd>/<file name>`, which the kernel resolves to the same inode. The file
//! system entry is the same socket either way; only the address passed to the syscall is shorter.

use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

/// Longest path `sun_path` holds (108 bytes minus the terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Calls `f` with an address for `path` that fits `sun_path`: `path` itself when it fits, else
/// `/proc/self/fd/<dirfd>/<file name>` with the directory held open for the duration of `f`.
///
/// # Errors
/// `InvalidInput` when `path` has no parent or file name, or the file name alone is too long;
/// the error of opening the parent directory; whatever `f` returns.
pub fn with_socket_address<T>(
    path: &Path,
    f: impl FnOnce(&Path) -> io::Result<T>,
) -> io::Result<T> {
    if path.as_os_str().len() <= MAX_SOCKET_PATH {
        return f(path);
    }
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "socket path {} has no parent directory or file name",
                path.display()
            ),
        ));
    };
    let dir_fd = rustix::fs::open(
        dir,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let short: PathBuf = Path::new("/proc/self/fd")
        .join(dir_fd.as_raw_fd().to_string())
        .join(name);
    if short.as_os_str().len() > MAX_SOCKET_PATH {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "socket file name {:?} is too long for a Unix socket address",
                name
            ),
        ));
    }
    let out = f(&short);
    drop(dir_fd);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::{UnixListener, UnixStream};

    /// A directory deep enough that the socket path exceeds `sun_path`.
    fn deep_dir(root: &Path) -> PathBuf {
        let mut d = root.to_path_buf();
        while d.as_os_str().len() < 150 {
            d = d.join("a-long-directory-name-of-a-pod-root");
        }
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_long_path_binds_and_connects_through_its_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let path = deep_dir(tmp.path()).join("tandem-store-client.sock");
        assert!(path.as_os_str().len() > MAX_SOCKET_PATH);
        // Negative control: the plain path is refused by the kernel.
        assert!(
            UnixListener::bind(&path).is_err(),
            "a {}-byte path must not fit sun_path",
            path.as_os_str().len()
        );

        let listener = with_socket_address(&path, |a| UnixListener::bind(a)).unwrap();
        assert!(path.exists(), "the socket appears at its real path");
        let _client = with_socket_address(&path, |a| UnixStream::connect(a)).unwrap();
        let (_conn, _) = listener.accept().unwrap();
    }

    #[test]
    fn a_short_path_is_used_as_is() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s.sock");
        let seen = with_socket_address(&path, |a| Ok(a.to_path_buf())).unwrap();
        assert_eq!(seen, path);
    }
}
