//! Transitional alias: the Mooncake trace moved to [`crate::tier::trace`] (its replay through the
//! prefix index) and [`crate::l3::replay`] (through the L3 store). `roles::prefill::prefix_cache`
//! still names `crate::cache::trace`; this module goes when it names the real one.

pub use crate::tier::trace;
