//! Which local program a container image stands for (pure).
//!
//! An image reference `[registry/]path/name[:tag][@digest]` is matched by its last path component
//! (`ghcr.io/tandem/tandem-worker:0.1.0` → `tandem-worker`) against an [`ImageTable`]. The entry's
//! `entrypoint` plays the image's `ENTRYPOINT`:
//!
//! * no `command` in the container: argv = entrypoint ++ args;
//! * `command` whose first element's file name equals the entrypoint program's file name
//!   (`/usr/local/bin/tandem-worker`): that element is replaced by the entrypoint, then the rest
//!   of `command`, then args — so pod specs written for the real image run unchanged;
//! * any other `command`: run as given on the host (`sh`, `python3`, ...), then args.
//!
//! Images not in the table are refused ([`ImageError::NotMapped`]); the pod then waits with reason
//! `ErrImagePull`, as with an unknown image on a real node.

use std::path::{Path, PathBuf};

/// Why a container cannot be mapped to a program.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    /// No table entry for the image.
    #[error("image {image:?} (name {name:?}) is not mapped to a local program")]
    NotMapped {
        /// The image reference.
        image: String,
        /// Its last path component.
        name: String,
    },
    /// The container has neither a mapped entrypoint nor a command.
    #[error("container has an empty command line")]
    EmptyCommand,
}

/// One image name → program mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageEntry {
    /// Last path component of the image repository (`tandem-worker`).
    pub name: String,
    /// Program and leading arguments (`["/…/target/debug/tandem-worker"]`).
    pub entrypoint: Vec<String>,
}

/// The image → program table of a runner.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageTable {
    entries: Vec<ImageEntry>,
}

impl ImageTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// The Tandem images: `tandem-worker` and `tandem-operator`, mapped to binaries located by
    /// [`locate_binary`].
    pub fn tandem() -> Self {
        Self::new()
            .with(
                "tandem-worker",
                vec![
                    locate_binary("tandem-worker", "TANDEM_WORKER_BIN")
                        .display()
                        .to_string(),
                ],
            )
            .with(
                "tandem-operator",
                vec![
                    locate_binary("tandem-operator", "TANDEM_OPERATOR_BIN")
                        .display()
                        .to_string(),
                ],
            )
    }

    /// Adds (or replaces) the mapping of image name `name`.
    pub fn with(mut self, name: &str, entrypoint: Vec<String>) -> Self {
        self.entries.retain(|e| e.name != name);
        self.entries.push(ImageEntry {
            name: name.to_owned(),
            entrypoint,
        });
        self
    }

    /// Parses `NAME=PROGRAM [ARGS...]` (whitespace-separated; the CLI's `--image`).
    pub fn with_spec(self, spec: &str) -> Option<Self> {
        let (name, rest) = spec.split_once('=')?;
        let entrypoint: Vec<String> = rest.split_whitespace().map(str::to_owned).collect();
        if name.is_empty() || entrypoint.is_empty() {
            return None;
        }
        Some(self.with(name, entrypoint))
    }

    /// The argv for a container (see the module doc for the rules).
    pub fn argv(
        &self,
        image: &str,
        command: &[String],
        args: &[String],
    ) -> Result<Vec<String>, ImageError> {
        let name = image_name(image);
        let entry = self
            .entries
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| ImageError::NotMapped {
                image: image.to_owned(),
                name: name.to_owned(),
            })?;
        let mut argv = match command.split_first() {
            None => entry.entrypoint.clone(),
            Some((first, rest)) if same_program(first, &entry.entrypoint) => {
                let mut v = entry.entrypoint.clone();
                v.extend(rest.iter().cloned());
                v
            }
            Some(_) => command.to_vec(),
        };
        argv.extend(args.iter().cloned());
        if argv.is_empty() {
            return Err(ImageError::EmptyCommand);
        }
        Ok(argv)
    }
}

fn same_program(command0: &str, entrypoint: &[String]) -> bool {
    let file = |s: &str| Path::new(s).file_name().map(|f| f.to_owned());
    entrypoint
        .first()
        .is_some_and(|e| file(e).is_some() && file(e) == file(command0))
}

/// The last path component of an image reference, without tag or digest.
pub fn image_name(image: &str) -> &str {
    let no_digest = image.split('@').next().unwrap_or(image);
    let last = no_digest.rsplit('/').next().unwrap_or(no_digest);
    // A ':' in the last component is the tag (a registry port lives in an earlier component).
    last.split(':').next().unwrap_or(last)
}

/// Where a workspace binary is: `$<env_var>` if set, else next to the running executable, else
/// one level up (test executables live in `target/<profile>/deps/`).
pub fn locate_binary(name: &str, env_var: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env_var) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().ok();
    let dir = exe.as_deref().and_then(Path::parent);
    if let Some(dir) = dir {
        let here = dir.join(name);
        if here.is_file() {
            return here;
        }
        if let Some(up) = dir.parent() {
            return up.join(name);
        }
    }
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn image_names() {
        assert_eq!(
            image_name("ghcr.io/tandem/tandem-worker:0.1.0"),
            "tandem-worker"
        );
        assert_eq!(
            image_name("localhost:5000/tandem-operator"),
            "tandem-operator"
        );
        assert_eq!(image_name("tandem-worker@sha256:abc"), "tandem-worker");
        assert_eq!(image_name("reg:5000/a/b:1@sha256:ff"), "b");
    }

    #[test]
    fn binaries_next_to_the_executable_or_from_env() {
        // Test executables live in target/<profile>/deps/: the workspace binaries one level up.
        let exe = std::env::current_exe().unwrap();
        let found = locate_binary("tandem-e2e-no-such-binary", "TANDEM_E2E_TEST_UNSET_VAR");
        assert_eq!(
            found,
            exe.parent()
                .unwrap()
                .parent()
                .unwrap()
                .join("tandem-e2e-no-such-binary")
        );
        // PATH is always set under cargo: use it as the override variable.
        let path = std::env::var("PATH").unwrap();
        assert_eq!(locate_binary("x", "PATH"), PathBuf::from(path));
    }

    #[test]
    fn argv_rules() {
        let t = ImageTable::new()
            .with("tandem-worker", s(&["/t/debug/tandem-worker"]))
            .with_spec("py-http=python3 -m http.server")
            .unwrap();
        let w = "ghcr.io/x/tandem-worker:1";
        assert_eq!(
            t.argv(w, &[], &s(&["decode"])).unwrap(),
            s(&["/t/debug/tandem-worker", "decode"])
        );
        assert_eq!(
            t.argv(
                w,
                &s(&["/usr/local/bin/tandem-worker", "prefill"]),
                &s(&["--x"])
            )
            .unwrap(),
            s(&["/t/debug/tandem-worker", "prefill", "--x"])
        );
        assert_eq!(
            t.argv(w, &s(&["sh", "-c", "true"]), &[]).unwrap(),
            s(&["sh", "-c", "true"])
        );
        assert_eq!(
            t.argv("py-http:3", &[], &s(&["8080"])).unwrap(),
            s(&["python3", "-m", "http.server", "8080"])
        );
        assert!(matches!(
            t.argv("nginx:1", &[], &[]),
            Err(ImageError::NotMapped { .. })
        ));
        assert!(ImageTable::new().with_spec("noequals").is_none());
        assert!(ImageTable::new().with_spec("x=").is_none());
    }
}
