//! `crdgen [--check] [DIR]`: writes the three CRDs into DIR (default `charts/tandem/crds`), or with
//! `--check` exits 1 when a committed file differs from what the types generate.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut check = false;
    let mut dir = None;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--check" => check = true,
            "-h" | "--help" => {
                println!("usage: crdgen [--check] [DIR]   (DIR defaults to charts/tandem/crds)");
                return ExitCode::SUCCESS;
            }
            other if !other.starts_with('-') && dir.is_none() => dir = Some(PathBuf::from(other)),
            other => {
                eprintln!("crdgen: unexpected argument {other:?} (see --help)");
                return ExitCode::from(2);
            }
        }
    }
    let dir = dir.unwrap_or_else(default_dir);
    let mut stale = Vec::new();
    for (file, crd) in tandem_crds::crdgen::all() {
        let path = dir.join(file);
        let text = match tandem_crds::crdgen::render(&crd) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("crdgen: cannot render {file}: {e}");
                return ExitCode::FAILURE;
            }
        };
        if check {
            match std::fs::read_to_string(&path) {
                Ok(committed) if committed == text => {}
                Ok(_) => stale.push(format!("{} differs", path.display())),
                Err(e) => stale.push(format!("{}: {e}", path.display())),
            }
        } else if let Err(e) =
            std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, text))
        {
            eprintln!("crdgen: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        } else {
            println!("wrote {}", path.display());
        }
    }
    if stale.is_empty() {
        if check {
            println!("crdgen: CRDs in {} are up to date", dir.display());
        }
        ExitCode::SUCCESS
    } else {
        for s in &stale {
            eprintln!("crdgen: {s}");
        }
        eprintln!("crdgen: run `cargo run -p tandem-crds --bin crdgen` and commit the result");
        ExitCode::FAILURE
    }
}

/// `charts/tandem/crds` at the workspace root, wherever the binary is started from inside it.
fn default_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/tandem/crds")
}
