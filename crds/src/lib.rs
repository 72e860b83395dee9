//! Tandem API types (`serving.tandem.dev/v1alpha1`).
