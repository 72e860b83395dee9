//! RDMA device probing through ibverbs (feature `rdma`).
//!
//! Build: `ibverbs-sys` compiles a vendored rdma-core with cmake and runs bindgen, so it needs
//! `cmake libclang-dev libibverbs-dev libnl-3-dev libnl-route-3-dev` (see
//! `e2e/tools/install-build-deps.sh`). Run time: with no uverbs device (`/sys/class/infiniband`
//! empty, or `devices()` failing with ENOSYS as on this project's machines) the probe fails with a
//! typed error and [`super::select`] falls back to TCP with a log line.
//!
//! Status: only the probe (device list → open → protection domain → a registered probe MR) is
//! implemented. The one-sided write path (QP handshake over the control plane, `IBV_WR_RDMA_WRITE`,
//! which ibverbs 0.9's safe API does not expose) is not; a machine with a device therefore still
//! selects TCP, and says so.

use std::io;

/// An RDMA device that opened and registered memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaDevice {
    /// Device name (e.g. `mlx5_0`).
    pub name: String,
    /// Number of devices listed.
    pub devices: usize,
}

/// Why no RDMA device is usable.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// Listing devices failed (no uverbs support in the kernel: ENOSYS).
    #[error("cannot list RDMA devices: {0}")]
    List(io::Error),
    /// The list is empty.
    #[error("no RDMA device present")]
    NoDevice,
    /// Opening the device, allocating a PD or registering the probe MR failed.
    #[error("RDMA device {device}: {step} failed: {source}")]
    Device {
        /// Device name.
        device: String,
        /// The failing step.
        step: &'static str,
        /// The OS error (ENOMEM/EPERM usually mean memlock limits).
        source: io::Error,
    },
}

/// Opens the first device, allocates a protection domain and registers a 4 KiB probe region.
pub fn probe() -> Result<RdmaDevice, RdmaError> {
    let list = ibverbs::devices().map_err(RdmaError::List)?;
    let count = list.len();
    let device = list.get(0).ok_or(RdmaError::NoDevice)?;
    let name = device
        .name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "unnamed".into());
    let err = |step: &'static str| {
        let device = name.clone();
        move |source| RdmaError::Device {
            device,
            step,
            source,
        }
    };
    let context = device.open().map_err(err("open"))?;
    let pd = context.alloc_pd().map_err(err("alloc_pd"))?;
    let mr = pd.allocate::<u8>(4096).map_err(err("reg_mr"))?;
    tracing::info!(device = %name, devices = count, rkey = mr.rkey().key, "RDMA device probe succeeded");
    Ok(RdmaDevice {
        name,
        devices: count,
    })
}
