//! Every CEL rule of the three CRDs, evaluated offline the way the API server evaluates it:
//! schema defaults applied first, then `x-kubernetes-validations` (kube's `cel` feature).
//!
//! The valid samples in `manifests/samples/` (and its `layersplit/` and `engines/`) pass; each file in `manifests/samples/invalid/` is
//! refused with the exact message its `# expect-message:` header names; and every rule in the
//! generated CRDs is covered by at least one invalid sample, so removing a rule fails a test.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kube::core::cel::Validator;
use serde_json::Value;

fn samples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/samples")
}

/// The openAPIV3Schema of the CRD for `kind`.
fn schema_for(kind: &str) -> Value {
    let crd = tandem_crds::crdgen::all()
        .into_iter()
        .map(|(_, crd)| crd)
        .find(|crd| crd.spec.names.kind == kind)
        .unwrap_or_else(|| panic!("no CRD for kind {kind}"));
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("derived CRD has a schema");
    serde_json::to_value(schema).expect("schema is JSON")
}

/// Parses every YAML document of a file into JSON values.
fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Validates `new` (against `old` for an update) like the API server: defaults, then CEL.
fn admit(new: &Value, old: Option<&Value>) -> Result<(), Vec<String>> {
    let kind = new["kind"].as_str().expect("sample has a kind");
    let schema = schema_for(kind);
    Validator::new()
        .validate_with_defaults(&schema, new, old)
        .map_err(|errs| errs.iter().map(|e| e.message.clone()).collect())
}

fn expected_message(path: &Path) -> String {
    let text = std::fs::read_to_string(path).expect("readable");
    text.lines()
        .find_map(|l| l.strip_prefix("# expect-message: "))
        .unwrap_or_else(|| panic!("{} has no '# expect-message:' header", path.display()))
        .to_owned()
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("samples dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    files
}

#[test]
fn valid_samples_pass_every_rule() {
    let files = yaml_files(&samples_dir());
    assert_eq!(
        files.len(),
        3,
        "the sample stack is a CacheTier, a PrefillPool and a DecodePool"
    );
    let layersplit = yaml_files(&samples_dir().join("layersplit"));
    assert_eq!(
        layersplit.len(),
        2,
        "the LayerSplit sample is a PrefillPool and a DecodePool"
    );
    let engines = yaml_files(&samples_dir().join("engines"));
    assert_eq!(
        engines.len(),
        4,
        "the engine samples are SGLang and vLLM stacks, and their prefill/decode"
    );
    for path in files.into_iter().chain(layersplit).chain(engines) {
        for doc in documents(&path) {
            assert_eq!(
                admit(&doc, None),
                Ok(()),
                "{} must be admitted",
                path.display()
            );
            // An update that changes nothing passes the transition rules too.
            assert_eq!(
                admit(&doc, Some(&doc)),
                Ok(()),
                "{} no-op update",
                path.display()
            );
        }
    }
}

#[test]
fn each_invalid_sample_is_refused_with_its_message() {
    let files = yaml_files(&samples_dir().join("invalid"));
    assert!(!files.is_empty());
    for path in files {
        let want = expected_message(&path);
        let docs = documents(&path);
        let result = match docs.as_slice() {
            [new] => admit(new, None),
            [old, new] => {
                // A transition sample: the stored object itself is fine; the update is not.
                assert_eq!(
                    admit(old, None),
                    Ok(()),
                    "{}: stored object",
                    path.display()
                );
                admit(new, Some(old))
            }
            _ => panic!("{}: one document, or two for an update", path.display()),
        };
        match result {
            Ok(()) => panic!("{} was admitted; expected {want:?}", path.display()),
            Err(messages) => assert_eq!(
                messages,
                vec![want.clone()],
                "{} must fail with exactly its own message",
                path.display()
            ),
        }
    }
}

/// Collects `message` of every `x-kubernetes-validations` entry under a schema.
fn rule_messages(schema: &Value, out: &mut BTreeSet<String>) {
    match schema {
        Value::Object(map) => {
            if let Some(Value::Array(rules)) = map.get("x-kubernetes-validations") {
                for r in rules {
                    let msg = r["message"].as_str().unwrap_or_else(|| {
                        panic!(
                            "rule {} has no message: every rule must tell the user what to change",
                            r["rule"]
                        )
                    });
                    out.insert(msg.to_owned());
                }
            }
            map.values().for_each(|v| rule_messages(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| rule_messages(v, out)),
        _ => {}
    }
}

#[test]
fn every_rule_has_an_invalid_sample() {
    let mut rules = BTreeSet::new();
    for kind in ["CacheTier", "PrefillPool", "DecodePool"] {
        rule_messages(&schema_for(kind), &mut rules);
    }
    let covered: BTreeSet<String> = yaml_files(&samples_dir().join("invalid"))
        .iter()
        .map(|p| expected_message(p))
        .collect();
    let uncovered: Vec<_> = rules.difference(&covered).collect();
    assert!(
        uncovered.is_empty(),
        "CEL rules without an invalid sample: {uncovered:#?}"
    );
    let stale: Vec<_> = covered.difference(&rules).collect();
    assert!(
        stale.is_empty(),
        "invalid samples naming no rule of the CRDs: {stale:#?}"
    );
    assert!(
        rules.len() >= 30,
        "expected the full rule set, found {}",
        rules.len()
    );
}

/// `spec.engine` as admitted on both pool kinds: `Simulated` without an image (it defaults to the
/// worker's), with extra args and resources; `SGLang` and `vLLM` with an image. The same blocks
/// without the image are refused. (The sample DecodePool's `speculative` and `prefill.kvDeadline`
/// are dropped for the real kinds: `real_engines_refuse_what_only_the_simulated_engine_serves`.)
#[test]
fn engine_blocks_are_admitted_when_they_name_what_they_need() {
    use serde_json::json;
    for file in ["prefillpool.yaml", "decodepool.yaml"] {
        let base = documents(&samples_dir().join(file)).remove(0);
        let with = |engine: Value| {
            let mut doc = base.clone();
            if engine["kind"] != "Simulated" {
                without_simulated_only_fields(&mut doc);
            }
            doc["spec"]["engine"] = engine;
            doc
        };
        for engine in [
            json!({"kind": "Simulated"}),
            json!({"kind": "Simulated", "args": ["--requests", "4"],
                   "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}),
            json!({"kind": "SGLang", "image": "lmsysorg/sglang:v0.5.4"}),
            json!({"kind": "vLLM", "image": "vllm/vllm-openai:v0.11.0", "args": ["--enforce-eager"]}),
        ] {
            assert_eq!(
                admit(&with(engine.clone()), None),
                Ok(()),
                "{file}: {engine}"
            );
        }
        // The adapters' flags belong to the operator: each one, alone or as `--flag=value`, is
        // refused for its kind (the CEL lists match the constants the docs name), while the other
        // kind and a longer flag with the same start pass.
        for (kind, other, owned) in [
            ("SGLang", "vLLM", &tandem_crds::SGLANG_OWNED_FLAGS[..]),
            ("vLLM", "SGLang", &tandem_crds::VLLM_OWNED_FLAGS[..]),
        ] {
            for flag in owned {
                for arg in [
                    flag.to_string(),
                    format!("{flag}=1"),
                    format!("{flag}.key=1"),
                ] {
                    let e = json!({"kind": kind, "image": "e:1", "args": ["--x", arg]});
                    let refused = admit(&with(e.clone()), None).expect_err(&e.to_string());
                    assert!(
                        refused[0].starts_with(&format!("engine.args of kind {kind} must not set")),
                        "{refused:?}"
                    );
                    let e = json!({"kind": other, "image": "e:1", "args": [arg]});
                    let owned_there = if other == "SGLang" {
                        &tandem_crds::SGLANG_OWNED_FLAGS[..]
                    } else {
                        &tandem_crds::VLLM_OWNED_FLAGS[..]
                    };
                    if !owned_there.contains(flag) {
                        assert_eq!(admit(&with(e.clone()), None), Ok(()), "{file}: {e}");
                    }
                }
                let e = json!({"kind": kind, "image": "e:1", "args": [format!("{flag}x")]});
                assert_eq!(admit(&with(e.clone()), None), Ok(()), "{file}: {e}");
            }
        }
        for kind in ["SGLang", "vLLM"] {
            assert_eq!(
                admit(&with(json!({"kind": kind})), None),
                Err(vec!["engine.image is required for kind SGLang and vLLM (only the Simulated engine defaults to the worker image)".to_owned()]),
                "{file}: {kind} without an image"
            );
        }
    }
}

/// Removes what only the Simulated engine serves from a sample pool: `speculative`,
/// `prefill.kvDeadline`, `layerSplit`.
fn without_simulated_only_fields(doc: &mut Value) {
    let spec = doc["spec"].as_object_mut().expect("a spec");
    spec.remove("speculative");
    spec.remove("layerSplit");
    if let Some(p) = spec.get_mut("prefill").and_then(Value::as_object_mut) {
        p.remove("kvDeadline");
    }
}

/// One field setting of `real_engines_refuse_what_only_the_simulated_engine_serves`: what it is,
/// how it is set on a pool document, the start of the message that refuses it beside a real engine.
type Case = (&'static str, Box<dyn Fn(&mut Value)>, &'static str);

/// Issue 14: beside an SGLang or vLLM engine the worker has no room, draft pool, spec guard, KV
/// deadline or LayerSplit group on its path, and a group of several pods would be several
/// independent engines: each such field is refused at admission for the real kinds with its
/// message, and admitted as written for the Simulated engine (the same documents).
#[test]
fn real_engines_refuse_what_only_the_simulated_engine_serves() {
    use serde_json::json;
    let parallel = "engine.kind SGLang and vLLM run one engine per pod";
    let prefill_only = "layerSplit and speculative take effect only with engine.kind Simulated";
    let decode_only = "speculative, and prefill.kvDeadline unless the DecodePool has no CacheTier";
    let speculative = json!({"draftModel": {"name": "llama-3.2-1b", "layers": 16,
        "attention": "GQA", "kvHeads": 8, "headDim": 64, "dtype": "BF16"}, "draftTokens": 4});
    for file in ["prefillpool.yaml", "decodepool.yaml"] {
        let mut base = documents(&samples_dir().join(file)).remove(0);
        without_simulated_only_fields(&mut base);
        let decode = file == "decodepool.yaml";
        let speculative = speculative.clone();
        let mut cases: Vec<Case> = vec![
            (
                "TP 2",
                Box::new(|d| d["spec"]["parallelism"]["tensor"] = json!(2)),
                parallel,
            ),
            (
                "speculative",
                Box::new(move |d| d["spec"]["speculative"] = speculative.clone()),
                if decode { decode_only } else { prefill_only },
            ),
        ];
        if decode {
            cases.push((
                "prefill.kvDeadline",
                Box::new(|d| d["spec"]["prefill"]["kvDeadline"] = json!({"milliseconds": 10000})),
                decode_only,
            ));
        } else {
            cases.push((
                "layerSplit with CP 2",
                Box::new(|d| {
                    d["spec"]["layerSplit"] = json!(true);
                    d["spec"]["parallelism"]["context"] = json!(2);
                }),
                prefill_only,
            ));
        }
        for (what, set, message) in &cases {
            let mut doc = base.clone();
            set(&mut doc);
            doc["spec"]["engine"] = json!({"kind": "Simulated"});
            assert_eq!(admit(&doc, None), Ok(()), "{file} {what} beside Simulated");
            for kind in ["SGLang", "vLLM"] {
                doc["spec"]["engine"] = json!({"kind": kind, "image": "e:1"});
                let refused = admit(&doc, None).expect_err(&format!("{file} {what} {kind}"));
                assert!(
                    refused.iter().any(|m| m.starts_with(message)),
                    "{file} {what} beside {kind}: {refused:?}"
                );
            }
        }
        if decode {
            // SGLang and vLLM prefill/decode through Tandem (no CacheTier): the front door hands
            // the KV deadline to the engine's transfer backend or connector, so it is admitted.
            let mut doc = base.clone();
            doc["spec"].as_object_mut().unwrap().remove("cacheTierRef");
            doc["spec"]["prefill"]["kvDeadline"] = json!({"milliseconds": 10000});
            for kind in ["SGLang", "vLLM"] {
                doc["spec"]["engine"] = json!({"kind": kind, "image": "e:1"});
                assert_eq!(admit(&doc, None), Ok(()), "{kind} PD with a KV deadline");
            }
        }
        // Without an engine (the worker's built-in simulated engine) every field is admitted too.
        let mut doc = base.clone();
        cases.iter().for_each(|(_, set, _)| set(&mut doc));
        assert_eq!(
            admit(&doc, None),
            Ok(()),
            "{file} with every field, no engine"
        );
    }
}
