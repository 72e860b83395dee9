//! `tandem-bench gpu` (feature `cuda`): KV page copies on one GPU as ratios of the device's own
//! peaks, measured in the same run (issue 16 item 4; DESIGN §7).
//!
//! Baseline per direction: one copy of the whole buffer (`--total-mib`) — the best the copy
//! engine does on this device and host. Measured: the same bytes moved page by page (`--page-kib`
//! each), pages taken from the source in a scattered order as a pool's free list hands them out:
//! - **H2D**: pinned host pages → device pages (the L2 → GPU load of contract 5);
//! - **D2H**: device pages → pinned host pages (the GPU → L2 write-back);
//! - **D2D**: device snapshot slots → device pool pages (the snapshot finalize copy of contract 4).
//!
//! Every figure is the best of `--repeats` runs, timed from the first enqueue to the stream's
//! synchronize. Host memory is pinned (`cuMemHostAlloc`): pageable memory would make the copies
//! synchronous and staging-bound. Without the `cuda` feature, `libcuda` or a device the bench
//! refuses with the reason (exit status 1), like the CUDA backend (`load::stream_cuda`).

/// Arguments of `tandem-bench gpu`.
#[derive(Debug, Clone, clap::Args)]
pub struct GpuArgs {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Bytes moved per direction and per run, MiB.
    #[arg(long, default_value_t = 512)]
    pub total_mib: usize,
    /// Page sizes, KiB (one (page, layer) chunk each).
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024,4096")]
    pub page_kib: Vec<usize>,
    /// Runs per figure (the best is kept).
    #[arg(long, default_value_t = 5)]
    pub repeats: u32,
}

/// One copy direction's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct DirectionReport {
    /// `H2D`, `D2H` or `D2D`.
    pub direction: &'static str,
    /// The whole buffer in one copy, bytes/s.
    pub peak_bytes_per_s: f64,
    /// (page size in bytes, bytes/s moving the same bytes page by page).
    pub pages: Vec<(usize, f64)>,
}

/// What `tandem-bench gpu` measured.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuReport {
    /// Device name as the driver reports it.
    pub device: String,
    /// Bytes moved per run.
    pub total_bytes: usize,
    /// H2D, D2H, D2D.
    pub directions: Vec<DirectionReport>,
}

impl GpuReport {
    /// Printable lines: each page figure as a ratio of its direction's peak.
    pub fn lines(&self) -> Vec<String> {
        let gbs = |b: f64| b / 1e9;
        let mut out = vec![format!(
            "gpu: {} ({} MiB per run, best of runs)",
            self.device,
            self.total_bytes >> 20
        )];
        for d in &self.directions {
            out.push(format!(
                "{} peak (one copy): {:.1} GB/s",
                d.direction,
                gbs(d.peak_bytes_per_s)
            ));
            for (page, rate) in &d.pages {
                out.push(format!(
                    "{} pages of {:>5} KiB: {:.1} GB/s = {:.2} × peak",
                    d.direction,
                    page >> 10,
                    gbs(*rate),
                    rate / d.peak_bytes_per_s
                ));
            }
        }
        out
    }
}

/// Why the bench could not run.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No usable device (no `cuda` feature, no `libcuda`, no such ordinal).
    #[error("no usable CUDA device: {0}")]
    Unavailable(String),
    /// A driver call failed.
    #[error("{call}: {message}")]
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Driver {
        /// The driver call.
        call: &'static str,
        /// The driver's message.
        message: String,
    },
    /// Arguments that describe no work.
    #[error("{0}")]
    BadArgs(String),
}

/// The order pages are taken in: a fixed permutation of `0..n` with the stride of a free list
/// that has seen churn (`i * stride mod n`, `stride` coprime to `n`), so page copies are not one
/// contiguous run in disguise.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn scattered(n: usize) -> Vec<usize> {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    let mut stride = (n / 2) | 1;
    while n > 1 && gcd(stride, n) != 1 {
        stride += 2;
    }
    (0..n).map(|i| (i * stride) % n.max(1)).collect()
}

/// Runs the bench.
///
/// # Errors
/// [`GpuError::Unavailable`] without a device, [`GpuError::BadArgs`] when a page size is 0 or
/// larger than the total, [`GpuError::Driver`] when a CUDA call fails.
pub fn run(args: &GpuArgs) -> Result<GpuReport, GpuError> {
    let total = args.total_mib << 20;
    if total == 0 || args.repeats == 0 {
        return Err(GpuError::BadArgs(
            "--total-mib and --repeats must be at least 1".into(),
        ));
    }
    if let Some(bad) = args
        .page_kib
        .iter()
        .find(|&&p| p == 0 || (p << 10) > total || !total.is_multiple_of(p << 10))
    {
        return Err(GpuError::BadArgs(format!(
            "page size {bad} KiB must be at least 1 and divide --total-mib {}",
            args.total_mib
        )));
    }
    device::run(args, total)
}

#[cfg(not(feature = "cuda"))]
mod device {
    use super::{GpuArgs, GpuError, GpuReport};

    pub(super) fn run(_: &GpuArgs, _: usize) -> Result<GpuReport, GpuError> {
        Err(GpuError::Unavailable(
            "this binary was built without the `cuda` feature".into(),
        ))
    }
}

#[cfg(feature = "cuda")]
mod device {
    use std::ffi::c_void;
    use std::sync::Arc;
    use std::time::Instant;

    use cudarc::driver::{CudaContext, CudaStream, DriverError, result, sys};

    use super::{DirectionReport, GpuArgs, GpuError, GpuReport, scattered};

    fn driver(call: &'static str) -> impl FnOnce(DriverError) -> GpuError {
        move |e| GpuError::Driver {
            call,
            message: e.to_string(),
        }
    }

    /// One pinned host buffer and two device buffers of `len` bytes, freed once on drop.
    struct Buffers {
        ctx: Arc<CudaContext>,
        host: *mut c_void,
        dev_a: sys::CUdeviceptr,
        dev_b: sys::CUdeviceptr,
        len: usize,
    }

    impl Buffers {
        fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, GpuError> {
            ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
            let mut b = Buffers {
                ctx: Arc::clone(ctx),
                host: std::ptr::null_mut(),
                dev_a: 0,
                dev_b: 0,
                len,
            };
            // SAFETY: the context is current; each pointer is freed once in `Drop` (null/0 skipped).
            unsafe {
                b.host = result::malloc_host(len, 0).map_err(driver("cuMemHostAlloc"))?;
                std::ptr::write_bytes(b.host.cast::<u8>(), 0x5a, len);
                b.dev_a = result::malloc_sync(len).map_err(driver("cuMemAlloc"))?;
                b.dev_b = result::malloc_sync(len).map_err(driver("cuMemAlloc"))?;
            }
            Ok(b)
        }

        fn host(&self) -> &[u8] {
            // SAFETY: `host` is `len` pinned bytes owned by `self`, initialised in `new`.
            unsafe { std::slice::from_raw_parts(self.host.cast::<u8>(), self.len) }
        }

        fn host_mut(&mut self) -> &mut [u8] {
            // SAFETY: as in `host`, and `&mut self` makes this the only view.
            unsafe { std::slice::from_raw_parts_mut(self.host.cast::<u8>(), self.len) }
        }
    }

    impl Drop for Buffers {
        fn drop(&mut self) {
            let _ = self.ctx.bind_to_thread();
            let _ = self.ctx.synchronize();
            // SAFETY: each allocation is freed once; nothing is in flight after the synchronize.
            unsafe {
                if self.dev_b != 0 {
                    let _ = result::free_sync(self.dev_b);
                }
                if self.dev_a != 0 {
                    let _ = result::free_sync(self.dev_a);
                }
                if !self.host.is_null() {
                    let _ = result::free_host(self.host);
                }
            }
        }
    }

    #[derive(Clone, Copy)]
    enum Dir {
        H2d,
        D2h,
        D2d,
    }

    /// Enqueues one direction's copies in `page`-byte pieces (`page == len`: one copy), then
    /// synchronizes; returns bytes/s.
    fn timed(b: &mut Buffers, s: &CudaStream, dir: Dir, page: usize) -> Result<f64, GpuError> {
        let n = b.len / page;
        let order = if n == 1 { vec![0] } else { scattered(n) };
        let stream = s.cu_stream();
        let (a, d) = (b.dev_a, b.dev_b);
        let start = Instant::now();
        for (dst_page, &src_page) in order.iter().enumerate() {
            let (src, dst) = (src_page * page, dst_page * page);
            // SAFETY: every range lies inside its `len`-byte buffer; the host buffer outlives
            // the synchronize below, and nothing else touches the buffers meanwhile.
            unsafe {
                match dir {
                    Dir::H2d => {
                        let host = &b.host()[src..src + page];
                        result::memcpy_htod_async(a + dst as u64, host, stream)
                            .map_err(driver("cuMemcpyHtoDAsync"))?;
                    }
                    Dir::D2h => {
                        let host = &mut b.host_mut()[dst..dst + page];
                        result::memcpy_dtoh_async(host, a + src as u64, stream)
                            .map_err(driver("cuMemcpyDtoHAsync"))?;
                    }
                    Dir::D2d => {
                        result::memcpy_dtod_async(d + dst as u64, a + src as u64, page, stream)
                            .map_err(driver("cuMemcpyDtoDAsync"))?;
                    }
                }
            }
        }
        s.synchronize().map_err(driver("cuStreamSynchronize"))?;
        Ok(b.len as f64 / start.elapsed().as_secs_f64().max(1e-9))
    }

    fn best(
        b: &mut Buffers,
        s: &CudaStream,
        dir: Dir,
        page: usize,
        repeats: u32,
    ) -> Result<f64, GpuError> {
        // One unmeasured run warms the copy engine and the page tables.
        timed(b, s, dir, page)?;
        let mut top = 0f64;
        for _ in 0..repeats {
            top = top.max(timed(b, s, dir, page)?);
        }
        Ok(top)
    }

    pub(super) fn run(args: &GpuArgs, total: usize) -> Result<GpuReport, GpuError> {
        // SAFETY: only probes whether the shared library can be loaded (an unguarded cudarc call
        // panics when it is absent, reference/rust-stack.md §4).
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::Unavailable(
                "the CUDA driver library (libcuda.so) cannot be loaded".into(),
            ));
        }
        let ctx = CudaContext::new(args.device)
            .map_err(|e| GpuError::Unavailable(format!("device {}: {e}", args.device)))?;
        let name = ctx
            .name()
            .unwrap_or_else(|_| format!("cuda:{}", args.device));
        let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        let mut bufs = Buffers::new(&ctx, total)?;
        let mut directions = Vec::new();
        for (label, dir) in [("H2D", Dir::H2d), ("D2H", Dir::D2h), ("D2D", Dir::D2d)] {
            let peak = best(&mut bufs, &stream, dir, total, args.repeats)?;
            let mut pages = Vec::new();
            for &kib in &args.page_kib {
                let page = kib << 10;
                pages.push((page, best(&mut bufs, &stream, dir, page, args.repeats)?));
            }
            directions.push(DirectionReport {
                direction: label,
                peak_bytes_per_s: peak,
                pages,
            });
        }
        Ok(GpuReport {
            device: name,
            total_bytes: total,
            directions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scattered_is_a_permutation_and_not_the_identity() {
        for n in [1usize, 2, 8, 12, 4096] {
            let mut p = scattered(n);
            let shuffled = n < 3 || p.iter().enumerate().any(|(i, &x)| i != x);
            p.sort_unstable();
            assert_eq!(p, (0..n).collect::<Vec<_>>(), "n = {n}");
            assert!(shuffled, "n = {n}: pages taken in order");
        }
    }

    #[test]
    fn page_sizes_that_do_not_divide_the_total_are_refused_before_any_device_call() {
        let args = GpuArgs {
            device: 0,
            total_mib: 1,
            page_kib: vec![64, 3],
            repeats: 1,
        };
        assert!(matches!(run(&args), Err(GpuError::BadArgs(m)) if m.contains("3 KiB")));
    }

    #[test]
    fn report_lines_are_ratios_of_the_peak() {
        let r = GpuReport {
            device: "test".into(),
            total_bytes: 1 << 29,
            directions: vec![DirectionReport {
                direction: "H2D",
                peak_bytes_per_s: 50e9,
                pages: vec![(64 << 10, 25e9)],
            }],
        };
        let lines = r.lines().join("\n");
        assert!(lines.contains("H2D peak (one copy): 50.0 GB/s"), "{lines}");
        assert!(lines.contains("64 KiB: 25.0 GB/s = 0.50 × peak"), "{lines}");
    }
}
