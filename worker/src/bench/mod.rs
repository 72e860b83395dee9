//! `tandem-bench` subcommands: speed and safety figures measured against a baseline in the same run
//! (DESIGN §7), each in its own module.

pub mod abort_stress;
pub mod layer_split;
pub mod loadback;
pub mod pool;
pub mod registration;
pub mod snapshot;
pub mod transfer;
