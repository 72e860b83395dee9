//! The P:D ratio: how many prefill instances per decode instance.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Largest accepted side of a ratio; keeps `ceil(decode × P / D)` far from overflow.
pub const MAX_RATIO_SIDE: u32 = 9999;

/// A prefill-to-decode ratio `P:D`, both sides positive integers (e.g. `4:1`: four prefill
/// instances for each decode instance).
///
/// On the wire it is the string `"P:D"`; the CRD carries a CEL rule with the same grammar so the
/// API server rejects a bad ratio at admission, and [`FromStr`] rejects it in code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PdRatio {
    prefill: u32,
    decode: u32,
}

/// Why a ratio string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RatioError {
    /// Not of the form `P:D`.
    #[error("ratio {0:?} is not of the form P:D (for example \"4:1\")")]
    Format(String),
    /// A side is zero, negative, not an integer, or above [`MAX_RATIO_SIDE`].
    #[error("ratio {0:?}: both sides must be integers from 1 to {MAX_RATIO_SIDE}")]
    Side(String),
}

impl PdRatio {
    /// Builds a ratio; both sides must be in `1..=MAX_RATIO_SIDE`.
    pub fn new(prefill: u32, decode: u32) -> Result<Self, RatioError> {
        let ok = |v: u32| (1..=MAX_RATIO_SIDE).contains(&v);
        if ok(prefill) && ok(decode) {
            Ok(Self { prefill, decode })
        } else {
            Err(RatioError::Side(format!("{prefill}:{decode}")))
        }
    }

    /// Prefill side `P`.
    pub fn prefill(&self) -> u32 {
        self.prefill
    }

    /// Decode side `D`.
    pub fn decode(&self) -> u32 {
        self.decode
    }

    /// Prefill instances for `decode_replicas` decode instances: `ceil(decode × P / D)`
    /// (DESIGN §2; issue "Operator"). Zero decode replicas need zero prefill.
    pub fn prefill_replicas_for(&self, decode_replicas: u32) -> u32 {
        let num = u64::from(decode_replicas) * u64::from(self.prefill);
        let den = u64::from(self.decode);
        // decode_replicas ≤ u32::MAX and P ≤ 9999, so the quotient fits in u32 only when the
        // caller passes sane replica counts; saturate rather than wrap.
        u32::try_from(num.div_ceil(den)).unwrap_or(u32::MAX)
    }
}

impl fmt::Display for PdRatio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.prefill, self.decode)
    }
}

impl FromStr for PdRatio {
    type Err = RatioError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (p, d) = s
            .split_once(':')
            .ok_or_else(|| RatioError::Format(s.to_owned()))?;
        let side = |x: &str| -> Result<u32, RatioError> {
            // Only plain decimal digits: no sign, no spaces, no leading zero.
            if x.is_empty() || !x.bytes().all(|b| b.is_ascii_digit()) || x.starts_with('0') {
                return Err(RatioError::Side(s.to_owned()));
            }
            x.parse().map_err(|_| RatioError::Side(s.to_owned()))
        };
        Self::new(side(p)?, side(d)?).map_err(|_| RatioError::Side(s.to_owned()))
    }
}

impl Serialize for PdRatio {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PdRatio {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = Cow::<str>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The CEL rule (and message) that enforces the grammar at admission.
pub const RATIO_RULE: &str = "self.matches('^[1-9][0-9]{0,3}:[1-9][0-9]{0,3}$')";
/// Message of [`RATIO_RULE`].
pub const RATIO_MESSAGE: &str =
    "prefill.ratio must be \"P:D\" with integers from 1 to 9999 on both sides, for example \"4:1\"";

impl schemars::JsonSchema for PdRatio {
    fn schema_name() -> Cow<'static, str> {
        "PdRatio".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "maxLength": 9,
            "description": "Prefill:decode instance ratio \"P:D\", e.g. \"4:1\".",
            "x-kubernetes-validations": [{"rule": RATIO_RULE, "message": RATIO_MESSAGE}],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_and_prints() {
        let r: PdRatio = "4:1".parse().unwrap();
        assert_eq!((r.prefill(), r.decode()), (4, 1));
        assert_eq!(r.to_string(), "4:1");
    }

    #[test]
    fn rejects_bad_ratios() {
        for bad in [
            "", "4", "4:", ":1", "0:1", "1:0", "-1:1", "+1:1", "01:1", "1.5:1", "4:1:1", " 4:1",
            "10000:1",
        ] {
            assert!(bad.parse::<PdRatio>().is_err(), "{bad:?} must be rejected");
        }
    }

    #[test]
    fn prefill_replicas_round_up() {
        let r = PdRatio::new(4, 1).unwrap();
        assert_eq!(r.prefill_replicas_for(0), 0);
        assert_eq!(r.prefill_replicas_for(2), 8);
        let r = PdRatio::new(3, 2).unwrap();
        assert_eq!(r.prefill_replicas_for(1), 2); // 1.5 → 2
        assert_eq!(r.prefill_replicas_for(2), 3);
    }

    proptest! {
        /// The code grammar and the CEL grammar agree: whatever parses prints back the same.
        #[test]
        fn roundtrip(p in 1u32..=MAX_RATIO_SIDE, d in 1u32..=MAX_RATIO_SIDE) {
            let r = PdRatio::new(p, d).unwrap();
            prop_assert_eq!(r.to_string().parse::<PdRatio>().unwrap(), r);
        }

        /// ceil: enough prefill (never fewer than the ratio asks), and never one more than needed.
        #[test]
        fn prefill_is_the_ceiling(p in 1u32..=64, d in 1u32..=64, dec in 0u32..=10_000) {
            let r = PdRatio::new(p, d).unwrap();
            let pre = u64::from(r.prefill_replicas_for(dec));
            let need = u64::from(dec) * u64::from(p);
            prop_assert!(pre * u64::from(d) >= need);
            prop_assert!(pre == 0 || (pre - 1) * u64::from(d) < need);
        }
    }
}
