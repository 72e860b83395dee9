//! Model identity and KV-cache geometry.
//!
//! A [`ModelIdentity`] names a model and fixes the shape of one token's KV entry on one layer. Every KV
//! pool (target, draft, indexer), the capacity plan, transfer descriptors and L3 object keys derive their
//! sizes from it, so there is exactly one formula (DESIGN §2, "model identity"; reference/dataplane.md
//! R-MEM-4: geometry is recomputed from the model descriptor, never copied by hand).
//!
//! The type is plain serde with no Kubernetes dependency: the operator embeds the same struct in
//! the resolved pool config it renders, and the worker reads it back from that file
//! (worker/interfaces/README.md §2).
//!
//! The catalogue format is `/work/shared/data/models.json`:
//! `{"models": [{"name": ..., "layers": 32, "attention": "gqa", "kv_heads": 8, "head_dim": 128,
//! "dtype_bytes": 2, "bytes_per_token": 131072}, ...]}`. `bytes_per_token` in the file is a checked
//! claim, not an input: [`ModelCatalog::from_json`] recomputes it and rejects a mismatch. Reading the
//! file is the caller's business (this crate does no I/O).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Attention family, which decides what one token stores per layer.
///
/// Serialised internally tagged on `attention` (`"gqa"`, `"mha"`, `"mla"`), flattened into
/// [`ModelIdentity`], exactly as in `models.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "attention", rename_all = "lowercase")]
pub enum Attention {
    /// Grouped-query attention: K and V, each `kv_heads × head_dim` elements per token per layer.
    Gqa {
        /// Number of KV heads (after grouping), per model (not per TP rank).
        kv_heads: u32,
        /// Elements per head.
        head_dim: u32,
    },
    /// Multi-head attention: same storage as GQA with `kv_heads` equal to the query heads.
    Mha {
        /// Number of KV heads.
        kv_heads: u32,
        /// Elements per head.
        head_dim: u32,
    },
    /// Multi-head latent attention (DeepSeek): one compressed latent of `kv_lora_rank` elements plus a
    /// decoupled RoPE key of `rope_dim` elements per token per layer (no separate V).
    Mla {
        /// Latent (compressed KV) width in elements.
        kv_lora_rank: u32,
        /// Decoupled rotary key width in elements.
        rope_dim: u32,
    },
}

impl Attention {
    /// KV elements stored per token per layer: `2 × kv_heads × head_dim` (GQA/MHA: K and V) or
    /// `kv_lora_rank + rope_dim` (MLA).
    pub fn kv_elems_per_token_layer(&self) -> u64 {
        match *self {
            Attention::Gqa { kv_heads, head_dim } | Attention::Mha { kv_heads, head_dim } => {
                2 * u64::from(kv_heads) * u64::from(head_dim)
            }
            Attention::Mla {
                kv_lora_rank,
                rope_dim,
            } => u64::from(kv_lora_rank) + u64::from(rope_dim),
        }
    }
}

/// Identity and KV geometry of one model (target or draft).
///
/// Two identities are the same model only if every field is equal; L3 objects and loadback compare the
/// whole struct (DESIGN contract 7).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// Model name, e.g. `llama-3-8b`. Must be non-empty.
    pub name: String,
    /// Number of transformer layers that hold KV. Must be ≥ 1.
    pub layers: u32,
    /// Attention family and its widths.
    #[serde(flatten)]
    pub attention: Attention,
    /// Bytes per KV element (2 for bf16/fp16, 1 for fp8). Must be ≥ 1.
    pub dtype_bytes: u32,
    /// Extra bytes per token per layer stored next to the KV row, e.g. quantisation scales
    /// (reference/dataplane.md R-MEM-4: host rows must include the scales the device rows carry).
    /// Absent in `models.json`, where it is 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub row_extra_bytes: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl ModelIdentity {
    /// Checks that every size is positive; the geometry functions assume a validated identity.
    ///
    /// # Errors
    /// [`ModelError::Invalid`] naming the model and the bad field.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |field: &'static str| ModelError::Invalid {
            model: self.name.clone(),
            field,
        };
        if self.name.is_empty() {
            return Err(bad("name"));
        }
        if self.layers == 0 {
            return Err(bad("layers"));
        }
        if self.dtype_bytes == 0 {
            return Err(bad("dtype_bytes"));
        }
        match self.attention {
            Attention::Gqa { kv_heads, head_dim } | Attention::Mha { kv_heads, head_dim } => {
                if kv_heads == 0 {
                    return Err(bad("kv_heads"));
                }
                if head_dim == 0 {
                    return Err(bad("head_dim"));
                }
            }
            Attention::Mla {
                kv_lora_rank,
                rope_dim,
            } => {
                if kv_lora_rank == 0 {
                    return Err(bad("kv_lora_rank"));
                }
                // rope_dim 0 is a legal (if unusual) MLA variant: the latent alone.
                let _ = rope_dim;
            }
        }
        Ok(())
    }

    /// Bytes of one token's KV on one layer, scales included:
    /// `kv_elems_per_token_layer × dtype_bytes + row_extra_bytes`.
    pub fn bytes_per_token_layer(&self) -> u64 {
        self.attention.kv_elems_per_token_layer() * u64::from(self.dtype_bytes)
            + u64::from(self.row_extra_bytes)
    }

    /// Bytes of one token's KV over all layers: `layers × bytes_per_token_layer`
    /// (e.g. llama-3-8b: 32 × 2·8·128 × 2 = 131072).
    pub fn bytes_per_token(&self) -> u64 {
        u64::from(self.layers) * self.bytes_per_token_layer()
    }
}

/// A set of model identities loaded from a `models.json`-shaped file.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ModelCatalog {
    /// The models, in file order.
    pub models: Vec<ModelIdentity>,
}

/// One entry as stored in the file: the identity plus the optional `bytes_per_token` claim.
#[derive(Deserialize)]
struct CatalogEntry {
    #[serde(flatten)]
    identity: ModelIdentity,
    bytes_per_token: Option<u64>,
}

#[derive(Deserialize)]
struct CatalogFile {
    models: Vec<CatalogEntry>,
}

impl ModelCatalog {
    /// Parses and validates catalogue JSON: every identity must pass [`ModelIdentity::validate`], names
    /// must be unique, and a stated `bytes_per_token` must equal the computed one.
    ///
    /// # Errors
    /// [`ModelError::Parse`], [`ModelError::Invalid`], [`ModelError::DuplicateName`],
    /// [`ModelError::BytesPerTokenMismatch`].
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let file: CatalogFile = serde_json::from_str(text)
            .map_err(|source| ModelError::Parse { path: None, source })?;
        let mut models: Vec<ModelIdentity> = Vec::with_capacity(file.models.len());
        for entry in file.models {
            entry.identity.validate()?;
            if let Some(stated) = entry.bytes_per_token {
                let computed = entry.identity.bytes_per_token();
                if stated != computed {
                    return Err(ModelError::BytesPerTokenMismatch {
                        model: entry.identity.name,
                        stated,
                        computed,
                    });
                }
            }
            if models.iter().any(|m| m.name == entry.identity.name) {
                return Err(ModelError::DuplicateName(entry.identity.name));
            }
            models.push(entry.identity);
        }
        Ok(Self { models })
    }

    /// Looks a model up by name.
    ///
    /// # Errors
    /// [`ModelError::UnknownModel`] listing the names that exist.
    pub fn get(&self, name: &str) -> Result<&ModelIdentity, ModelError> {
        self.models
            .iter()
            .find(|m| m.name == name)
            .ok_or_else(|| ModelError::UnknownModel {
                name: name.to_owned(),
                known: self.models.iter().map(|m| m.name.clone()).collect(),
            })
    }
}

/// Errors of model identities and catalogues.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The catalogue is not valid JSON of the expected shape.
    #[error("model catalogue {} is malformed: {source}", path.as_deref().map(|p| p.display().to_string()).unwrap_or_else(|| "<inline>".into()))]
    Parse {
        /// The file, when the caller that read it attached its path ([`ModelCatalog::from_json`]
        /// leaves it `None`).
        path: Option<PathBuf>,
        /// Parser error (with line and column).
        source: serde_json::Error,
    },
    /// A size field is zero or the name is empty.
    #[error("model {model:?}: field `{field}` must be positive (or non-empty)")]
    Invalid {
        /// Model name (possibly empty).
        model: String,
        /// Offending field.
        field: &'static str,
    },
    /// The file states a `bytes_per_token` that disagrees with the geometry.
    #[error(
        "model {model}: bytes_per_token is {stated} in the file but the geometry gives {computed}"
    )]
    BytesPerTokenMismatch {
        /// Model name.
        model: String,
        /// Value in the file.
        stated: u64,
        /// Value from [`ModelIdentity::bytes_per_token`].
        computed: u64,
    },
    /// Two entries share a name.
    #[error("model {0} appears twice in the catalogue")]
    DuplicateName(String),
    /// No model of that name.
    #[error("unknown model {name:?}; the catalogue has {known:?}")]
    UnknownModel {
        /// Name asked for.
        name: String,
        /// Names available.
        known: Vec<String>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_stated_size_is_rejected() {
        let json = r#"{"models":[{"name":"m","layers":2,"attention":"gqa","kv_heads":1,"head_dim":4,"dtype_bytes":2,"bytes_per_token":1}]}"#;
        match ModelCatalog::from_json(json) {
            Err(ModelError::BytesPerTokenMismatch { computed, .. }) => assert_eq!(computed, 32),
            other => panic!("expected mismatch, got {other:?}"),
        }
    }

    #[test]
    fn mla_and_round_trip() {
        let m = ModelIdentity {
            name: "d".into(),
            layers: 61,
            attention: Attention::Mla {
                kv_lora_rank: 512,
                rope_dim: 64,
            },
            dtype_bytes: 2,
            row_extra_bytes: 0,
        };
        assert_eq!(m.bytes_per_token(), 70_272);
        let s = serde_json::to_string(&m).unwrap();
        assert!(s.contains(r#""attention":"mla""#), "{s}");
        let back: ModelIdentity = serde_json::from_str(&s).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn malformed_inputs_are_typed_errors() {
        assert!(matches!(
            ModelCatalog::from_json("{"),
            Err(ModelError::Parse { .. })
        ));
        let zero = r#"{"models":[{"name":"m","layers":0,"attention":"mha","kv_heads":1,"head_dim":4,"dtype_bytes":2}]}"#;
        assert!(matches!(
            ModelCatalog::from_json(zero),
            Err(ModelError::Invalid {
                field: "layers",
                ..
            })
        ));
        let unknown_attn =
            r#"{"models":[{"name":"m","layers":1,"attention":"linear","dtype_bytes":2}]}"#;
        assert!(matches!(
            ModelCatalog::from_json(unknown_attn),
            Err(ModelError::Parse { .. })
        ));
        let dup = r#"{"models":[{"name":"m","layers":1,"attention":"mha","kv_heads":1,"head_dim":4,"dtype_bytes":2},{"name":"m","layers":1,"attention":"mha","kv_heads":1,"head_dim":4,"dtype_bytes":2}]}"#;
        assert!(matches!(
            ModelCatalog::from_json(dup),
            Err(ModelError::DuplicateName(_))
        ));
        let cat = ModelCatalog::from_json(r#"{"models":[]}"#).unwrap();
        assert!(matches!(cat.get("x"), Err(ModelError::UnknownModel { .. })));
    }

    #[test]
    fn scales_are_part_of_the_row() {
        // reference R-MEM-4: a 512 B/token/layer row with 16 B of scales is 528 B.
        let m = ModelIdentity {
            name: "q".into(),
            layers: 1,
            attention: Attention::Mla {
                kv_lora_rank: 448,
                rope_dim: 64,
            },
            dtype_bytes: 1,
            row_extra_bytes: 16,
        };
        assert_eq!(m.bytes_per_token_layer(), 528);
    }
}
