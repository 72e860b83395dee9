//! Tandem end-to-end harness (see DESIGN §6).
