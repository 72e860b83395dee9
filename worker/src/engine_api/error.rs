//! Typed refusals of the engine API: a gRPC code plus a machine-readable [`pb::ErrorReason`] carried in
//! the status details (an encoded [`pb::Error`]) and in the trailing metadata key
//! [`REASON_METADATA`] (engine.proto, "Errors").

use prost::Message;
use tonic::{Code, Status};

use super::pb;

/// Trailing-metadata key that repeats the reason's name for clients that do not decode details.
pub const REASON_METADATA: &str = "tandem-error-reason";

/// Checks a page list against a pool of `count` pages: every page in range, none twice.
///
/// # Errors
/// `PAGE_OUT_OF_RANGE` for the first page `>= count`; `MALFORMED` (field `pages`) for the first
/// page listed twice.
pub fn check_pages(pages: &[u32], count: u32) -> Result<(), ApiError> {
    let mut seen = std::collections::BTreeSet::new();
    for &p in pages {
        if p >= count {
            return Err(ApiError::page_out_of_range(p, count));
        }
        if !seen.insert(p) {
            return Err(ApiError::malformed(
                "pages",
                format!("page {p} is listed twice"),
            ));
        }
    }
    Ok(())
}

/// A typed refusal: what the server answers instead of panicking, and what the client decodes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason:?} ({code:?}): {message}")]
pub struct ApiError {
    /// The gRPC status code.
    pub code: Code,
    /// The machine-readable reason.
    pub reason: pb::ErrorReason,
    /// Human-readable detail: what to change.
    pub message: String,
    /// Offending field, dotted (identity mismatches and malformed input), else empty.
    pub field: String,
    /// The worker's value (mismatches), else empty.
    pub ours: String,
    /// The engine's value (mismatches), else empty.
    pub theirs: String,
}

impl ApiError {
    /// A refusal with `code`, `reason` and `message` and no field.
    pub fn new(code: Code, reason: pb::ErrorReason, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            field: String::new(),
            ours: String::new(),
            theirs: String::new(),
        }
    }

    /// Names the offending field.
    pub fn field(mut self, field: impl Into<String>) -> Self {
        self.field = field.into();
        self
    }

    /// Adds the two sides of a mismatch.
    pub fn sides(mut self, ours: impl Into<String>, theirs: impl Into<String>) -> Self {
        self.ours = ours.into();
        self.theirs = theirs.into();
        self
    }

    /// INVALID_ARGUMENT / `MALFORMED` naming `field`.
    pub fn malformed(field: &str, message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, pb::ErrorReason::Malformed, message).field(field)
    }

    /// INVALID_ARGUMENT / `PAGE_OUT_OF_RANGE`.
    pub fn page_out_of_range(page: u32, pages: u32) -> Self {
        Self::new(
            Code::InvalidArgument,
            pb::ErrorReason::PageOutOfRange,
            format!("page {page} is out of range (the pools have {pages} pages)"),
        )
        .field("pages")
    }

    /// FAILED_PRECONDITION / `NOT_ATTACHED`.
    pub fn not_attached(attach_id: u64) -> Self {
        Self::new(
            Code::FailedPrecondition,
            pb::ErrorReason::NotAttached,
            format!("attach id {attach_id} is not the current attach of this worker; call Attach"),
        )
        .field("attach_id")
    }

    /// DEADLINE_EXCEEDED / `DEADLINE_EXCEEDED`.
    pub fn deadline(what: &str, after: std::time::Duration) -> Self {
        Self::new(
            Code::DeadlineExceeded,
            pb::ErrorReason::DeadlineExceeded,
            format!("{what} did not finish within its deadline of {after:?}"),
        )
    }

    /// INTERNAL / `INTERNAL`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, pb::ErrorReason::Internal, message)
    }

    /// The wire form of the reason.
    pub fn to_proto(&self) -> pb::Error {
        pb::Error {
            reason: self.reason as i32,
            message: self.message.clone(),
            field: self.field.clone(),
            ours: self.ours.clone(),
            theirs: self.theirs.clone(),
        }
    }

    /// The status the server answers: `code`, `message`, details = encoded [`pb::Error`], and the
    /// reason's name under [`REASON_METADATA`].
    pub fn to_status(&self) -> Status {
        let mut metadata = tonic::metadata::MetadataMap::new();
        if let Ok(v) = self.reason.as_str_name().parse() {
            metadata.insert(REASON_METADATA, v);
        }
        Status::with_details_and_metadata(
            self.code,
            self.message.clone(),
            self.to_proto().encode_to_vec().into(),
            metadata,
        )
    }

    /// Decodes a status answered by an engine-API server; `None` when it carries no typed error (a
    /// transport failure, or a status from something else).
    pub fn from_status(status: &Status) -> Option<Self> {
        let e = pb::Error::decode(status.details()).ok()?;
        let reason = pb::ErrorReason::try_from(e.reason).ok()?;
        if reason == pb::ErrorReason::Unspecified {
            return None;
        }
        Some(Self {
            code: status.code(),
            reason,
            message: e.message,
            field: e.field,
            ours: e.ours,
            theirs: e.theirs,
        })
    }
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Self {
        e.to_status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_round_trip_keeps_the_reason_and_sides() {
        let e = ApiError::new(
            Code::FailedPrecondition,
            pb::ErrorReason::IdentityMismatch,
            "model.layers differs",
        )
        .field("model.layers")
        .sides("32", "40");
        let s = e.to_status();
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert_eq!(
            s.metadata().get(REASON_METADATA).unwrap(),
            "IDENTITY_MISMATCH"
        );
        assert_eq!(ApiError::from_status(&s), Some(e));
        assert_eq!(ApiError::from_status(&Status::unavailable("down")), None);
    }
}
