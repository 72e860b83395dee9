//! Issue 4, suite 1 (admission half): the generated CRDs are accepted by a real v1.37 API server,
//! the sample stack (and the SGLang and vLLM samples) is admitted, `kubectl get tandem` and `kubectl scale dcp` work, and every
//! file in `manifests/samples/invalid/` is refused **by the server** with the exact message its
//! `# expect-message:` header names. The offline CEL tests in `crds/` cannot see what the
//! server's CEL environment lacks (this suite caught `Quantity.sign()`, which kube-cel accepts
//! and the API server's CRD environment does not).
//!
//! Skips with a printed reason when the control-plane binaries are not built, unless
//! `TANDEM_E2E_REQUIRE_CLUSTER` is set.

mod support;

use std::process::Command;

use tandem_e2e::cluster::down::down;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crds_samples_and_cel_rules_on_a_real_api_server() {
    let Some(support::PrivateCluster { cluster, tmp }) = support::start_cluster(
        "crds_samples_and_cel_rules_on_a_real_api_server",
        support::ClusterShape {
            port_offset: 3000,
            controller_manager: false,
            scheduler: false,
            kwok_nodes: 0,
            kwok_gpus_per_node: 0,
        },
    )
    .await
    else {
        return;
    };
    let kubectl = cluster.bin_dir.kubectl();
    let kc = cluster.kubeconfig.clone();
    let run = |args: &[&str]| {
        let out = Command::new(&kubectl)
            .args(args)
            .env("KUBECONFIG", &kc)
            .current_dir(support::repo())
            .output()
            .expect("kubectl runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let (ok, out) = run(&["apply", "--server-side", "-f", "charts/tandem/crds/"]);
        assert!(ok, "the API server must accept the generated CRDs:\n{out}");
        let (ok, out) = run(&[
            "wait",
            "--for=condition=Established",
            "crd",
            "--all",
            "--timeout=60s",
        ]);
        assert!(ok, "{out}");
        for f in ["cachetier", "prefillpool", "decodepool"] {
            let (ok, out) = run(&["apply", "-f", &format!("manifests/samples/{f}.yaml")]);
            assert!(ok, "sample {f} must be admitted:\n{out}");
        }
        let (ok, out) = run(&["get", "tandem", "-o", "name"]);
        assert!(ok, "{out}");
        assert_eq!(
            out.lines().count(),
            3,
            "`kubectl get tandem` lists the three kinds:\n{out}"
        );
        let (ok, out) = run(&["scale", "dcp", "llama70b-decode", "--replicas=2"]);
        assert!(ok, "the scale subresource works: {out}");
        let (_, out) = run(&[
            "get",
            "dcp",
            "llama70b-decode",
            "-o",
            "jsonpath={.spec.replicas}",
        ]);
        assert_eq!(out.trim(), "2");

        // The engine samples (issue 14): SGLang and vLLM stacks, and vLLM prefill/decode through
        // Tandem (its DecodePool's KV deadline included), admitted as written.
        for f in [
            "engines/sglang",
            "engines/sglang-pd",
            "engines/vllm",
            "engines/vllm-pd",
        ] {
            let (ok, out) = run(&["apply", "-f", &format!("manifests/samples/{f}.yaml")]);
            assert!(ok, "sample {f} must be admitted:\n{out}");
        }
        let dir = support::repo().join("manifests/samples/invalid");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(files.len() >= 30);
        for path in files {
            let text = std::fs::read_to_string(&path).unwrap();
            let want = text
                .lines()
                .find_map(|l| l.strip_prefix("# expect-message: "))
                .expect("header")
                .to_owned();
            // A transition sample holds the stored object and then the update: the samples above
            // are the stored objects, so only the update is sent.
            let doc = text.split("\n---\n").last().unwrap().to_owned();
            let file = tmp.path().join(path.file_name().unwrap());
            std::fs::write(&file, doc).unwrap();
            let (ok, out) = run(&["apply", "--dry-run=server", "-f", file.to_str().unwrap()]);
            assert!(!ok, "{} was admitted by the API server", path.display());
            assert!(
                out.contains(&want),
                "{}: server said\n{out}\nexpected the message {want:?}",
                path.display()
            );
        }
    }));
    down(&cluster.config, false).await.expect("down");
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}
