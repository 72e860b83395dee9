//! Kubernetes quantities as byte counts (parsing by the `kube_quantity` crate).

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube_quantity::ParsedQuantity;

/// A quantity that is not a whole, non-negative number of bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {value:?} is not a non-negative byte quantity (e.g. 512Mi, 64Gi)")]
pub struct QuantityError {
    /// Spec field, e.g. `spec.hostPool.size`.
    pub field: &'static str,
    /// The text given.
    pub value: String,
}

/// Bytes of `q` (`1Gi` = 2^30, `1G` = 10^9); fractional bytes round up.
///
/// # Errors
/// [`QuantityError`] naming `field` when `q` does not parse or is negative.
pub fn bytes(field: &'static str, q: &Quantity) -> Result<u64, QuantityError> {
    let err = || QuantityError {
        field,
        value: q.0.clone(),
    };
    let parsed = ParsedQuantity::try_from(q).map_err(|_| err())?;
    let f = parsed.to_bytes_f64().ok_or_else(err)?;
    if !(f >= 0.0 && f.is_finite()) {
        return Err(err());
    }
    // Exact for integers below 2^53 (8 PiB); sizes here are far below that.
    parsed
        .to_bytes_u64()
        .or(Some(f.ceil() as u64))
        .ok_or_else(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_and_decimal_suffixes() {
        let b = |s: &str| bytes("f", &Quantity(s.into()));
        assert_eq!(b("1Gi"), Ok(1 << 30));
        assert_eq!(b("256Mi"), Ok(256 << 20));
        assert_eq!(b("1G"), Ok(1_000_000_000));
        assert_eq!(b("4096"), Ok(4096));
        assert!(b("-1Gi").is_err());
        assert!(b("banana").is_err());
    }
}
