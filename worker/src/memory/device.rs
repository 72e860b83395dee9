//! GPU device memory: the `Device` domain (feature `cuda`; DESIGN §3 "Device memory").
//!
//! Built on cudarc with dynamic loading, so the crate compiles without a CUDA toolkit. Without the
//! feature, or on a host without `libcuda`, or without a usable device, [`DeviceBackend::new`] returns
//! [`MemoryError::DeviceUnavailable`] — it never panics (an unguarded cudarc call does, when the library
//! is absent: reference/rust-stack.md §4, so the presence check comes first).

use super::allocator::{AllocatorBackend, MemoryError, RawRegion};
use super::domain::AllocatorDomain;

/// Backend of the `Device` domain: `cuMemAlloc`/`cuMemFree` on one device's primary context.
#[derive(Debug)]
pub struct DeviceBackend {
    ordinal: usize,
    #[cfg(feature = "cuda")]
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
}

impl DeviceBackend {
    /// Opens device `ordinal`.
    ///
    /// # Errors
    /// [`MemoryError::DeviceUnavailable`] when built without `cuda`, when `libcuda` cannot be loaded,
    /// or when the driver reports no such device.
    pub fn new(ordinal: usize) -> Result<Self, MemoryError> {
        #[cfg(feature = "cuda")]
        {
            // SAFETY: only probes whether the shared library can be loaded.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(MemoryError::DeviceUnavailable {
                    reason: "the CUDA driver library (libcuda.so) cannot be loaded".into(),
                });
            }
            let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| {
                MemoryError::DeviceUnavailable {
                    reason: format!("device {ordinal}: {e}"),
                }
            })?;
            Ok(Self { ordinal, ctx })
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(MemoryError::DeviceUnavailable {
                reason: format!(
                    "device {ordinal}: this binary was built without the `cuda` feature"
                ),
            })
        }
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl AllocatorBackend for DeviceBackend {
    fn domain(&self) -> AllocatorDomain {
        AllocatorDomain::Device
    }
    fn kind(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }
    fn allocate(&self, len: usize) -> Result<RawRegion, MemoryError> {
        #[cfg(feature = "cuda")]
        {
            let dev = |call: &'static str| {
                move |e: cudarc::driver::DriverError| MemoryError::Device {
                    call,
                    message: e.to_string(),
                }
            };
            self.ctx.bind_to_thread().map_err(dev("cuCtxSetCurrent"))?;
            // SAFETY: the context is current on this thread; the pointer is freed only by `release`.
            let ptr =
                unsafe { cudarc::driver::result::malloc_sync(len) }.map_err(dev("cuMemAlloc"))?;
            Ok(RawRegion {
                addr: ptr as usize,
                len,
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            // Unreachable in practice: `new` never builds a backend without the feature.
            Err(MemoryError::DeviceUnavailable {
                reason: format!("cannot allocate {len} bytes: built without `cuda`"),
            })
        }
    }
    unsafe fn release(&self, region: RawRegion) -> Result<(), MemoryError> {
        #[cfg(feature = "cuda")]
        {
            let dev = |call: &'static str| {
                move |e: cudarc::driver::DriverError| MemoryError::Device {
                    call,
                    message: e.to_string(),
                }
            };
            self.ctx.bind_to_thread().map_err(dev("cuCtxSetCurrent"))?;
            // SAFETY: `region.addr` came from `malloc_sync` in this context (caller's contract).
            unsafe {
                cudarc::driver::result::free_sync(region.addr as cudarc::driver::sys::CUdeviceptr)
            }
            .map_err(dev("cuMemFree"))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = region;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_device_is_a_typed_error_not_a_panic() {
        // On machines without a GPU (CI, this repository's dev host) this must be a typed error; on the
        // device machine with `--features cuda` it allocates and frees 1 MiB.
        match DeviceBackend::new(0) {
            Err(MemoryError::DeviceUnavailable { reason }) => assert!(!reason.is_empty()),
            Err(e) => panic!("unexpected error {e}"),
            Ok(backend) => {
                let a = crate::memory::Allocator::new("gpu", backend);
                let b = a.allocate(1 << 20, "device KV pool").unwrap();
                assert_eq!(b.domain(), AllocatorDomain::Device);
                assert!(b.host_ptr().is_err());
                b.free().unwrap();
            }
        }
    }
}
