//! Tandem operator library (see DESIGN §4).
