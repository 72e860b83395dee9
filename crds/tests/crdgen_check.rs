//! The committed CRD YAML in `charts/tandem/crds/` is what the types generate (`crdgen --check`).

use std::process::Command;

#[test]
fn committed_crds_are_up_to_date() {
    let out = Command::new(env!("CARGO_BIN_EXE_crdgen"))
        .arg("--check")
        .output()
        .expect("crdgen runs");
    assert!(
        out.status.success(),
        "crdgen --check failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn check_detects_drift() {
    let dir = std::env::temp_dir().join(format!("tandem-crdgen-{}", std::process::id()));
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_crdgen"))
            .args(args)
            .output()
            .expect("crdgen runs")
    };
    let d = dir.to_str().unwrap();
    assert!(run(&[d]).status.success());
    assert!(run(&["--check", d]).status.success());
    let f = dir.join("decodepools.serving.tandem.dev.yaml");
    let text = std::fs::read_to_string(&f).unwrap();
    std::fs::write(&f, text.replace("minAcceptLength", "minAcceptLen")).unwrap();
    assert!(
        !run(&["--check", d]).status.success(),
        "an edited CRD must fail the check"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Every committed CRD carries `helm.sh/resource-policy: keep` (issue 19 item 6: a CRD adopted
/// into a Helm release without it is deleted by `helm uninstall`, and the whole stack with it).
#[test]
fn every_crd_is_kept_by_helm() {
    for (file, crd) in tandem_crds::crdgen::all() {
        let policy = crd
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(tandem_crds::crdgen::HELM_RESOURCE_POLICY));
        assert_eq!(policy.map(String::as_str), Some("keep"), "{file}");
        let text = tandem_crds::crdgen::render(&crd).unwrap();
        assert!(
            text.contains("    helm.sh/resource-policy: keep\n"),
            "{file}: the rendered YAML lacks the policy"
        );
    }
}
