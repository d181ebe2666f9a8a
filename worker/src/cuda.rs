//! GPU workers (`--features cuda`): push and pull tensors that live in device memory.
//!
//! The CUDA libraries are loaded at run time (cudarc's `dynamic-loading`), so this builds
//! and runs on machines without CUDA; [`Gpu::open`] then fails with
//! [`WorkerError::NoCudaDriver`] instead of cudarc's panic (see [`probe_driver`]).
//!
//! **Staging path** (the one implemented): gradients go device-to-host on a copy stream
//! straight into the worker's registered buffers (`staging.rs`), which are page-locked with
//! `cuMemHostRegister` (the whole PS connection pool once, so the pinned buffer *is* the
//! transport's registered buffer and the send needs no further copy). The copies are
//! enqueued PS by PS, smallest group first, with an event after each group; the request to a
//! PS leaves as soon as its group's event completes, while the copies for the next PS still
//! run: copy of group i+1 overlaps the send of group i. Where memory cannot be registered,
//! the part is copied through a `cuMemHostAlloc` buffer instead and the reason is logged and
//! reported ([`Gpu::pinning`]). Fresh values come back host-to-device on the same stream.
//!
//! **GPUDirect RDMA and CUDA IPC** are detected, not implemented: [`Gpu::paths`] says what
//! the device and the channel would allow and why staging is used (see `docs/gpu.md`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DriverError, PinnedHostSlice};
use ibex_transport::Pool;

use crate::client::Worker;
use crate::error::WorkerError;
use crate::staging::Slot;

/// Driver functions Ibex calls through cudarc. A driver that lacks one of them would make
/// cudarc panic on first use ("Missing symbol"), so [`probe_driver`] checks them first.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemsetD8Async",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemGetInfo_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
];

/// Checks that the CUDA driver library loads and has every function Ibex uses, so that
/// cudarc (which panics on a missing library or symbol) is only called when it will work.
pub fn probe_driver() -> Result<(), WorkerError> {
    // SAFETY: only tries to dlopen the candidate names (cudarc's own search list); loading
    // libcuda runs no code of ours.
    if !unsafe { sys::is_culib_present() } {
        let names = cudarc::get_lib_name_candidates("cuda");
        let mut shown: Vec<&str> = names
            .iter()
            .map(String::as_str)
            .filter(|n| n.starts_with("libcuda.so"))
            .collect();
        shown.dedup();
        return Err(WorkerError::NoCudaDriver {
            detail: format!("could not load any of {shown:?}"),
        });
    }
    // SAFETY: the library is present (checked above), so `culib` loads it instead of
    // panicking; `get` only looks the names up.
    let lib = unsafe { sys::culib() };
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        // SAFETY: looks the symbol up without calling it; the pointer type is irrelevant.
        .filter(|name| unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(WorkerError::NoCudaDriver {
            detail: format!(
                "the driver library lacks {missing:?} (a CUDA 12.4 or newer driver is needed)"
            ),
        });
    }
    Ok(())
}

/// Whether the driver exports `name` (for optional features such as DMA-BUF export).
fn has_symbol(name: &str) -> bool {
    // SAFETY: only called after `probe_driver` succeeded, so the library loads.
    unsafe { sys::culib().get::<*const ()>(name.as_bytes()).is_ok() }
}

/// Maps a driver error to the typed worker error: out of memory and missing devices get
/// their own variants. Uses only the code's name: formatting a `DriverError` calls into the
/// driver, which may be absent.
pub(crate) fn driver_err(op: &str, e: DriverError, bytes: usize) -> WorkerError {
    match e.0 {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => WorkerError::CudaOutOfMemory {
            op: op.to_string(),
            bytes,
        },
        CUresult::CUDA_ERROR_NO_DEVICE | CUresult::CUDA_ERROR_INVALID_DEVICE => {
            WorkerError::NoCudaDevice {
                detail: format!("{op}: {:?}", e.0),
            }
        }
        CUresult::CUDA_ERROR_NOT_INITIALIZED | CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => {
            WorkerError::NoCudaDriver {
                detail: format!("{op}: {:?}", e.0),
            }
        }
        code => WorkerError::Cuda {
            op: op.to_string(),
            code: format!("{code:?}"),
        },
    }
}

/// Why a transfer path beyond staging is or is not used, as detected at [`Gpu::open`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuPaths {
    /// The device name.
    pub device: String,
    /// GPUDirect RDMA (device memory registered with the NIC through DMA-BUF): always
    /// `Err(reason)` today; the reason says whether the device would allow it.
    pub gpudirect_rdma: Result<(), String>,
    /// CUDA IPC between GPU peers on one node: always `Err(reason)` today.
    pub cuda_ipc: Result<(), String>,
}

/// How one host range is page-locked for DMA.
enum Pin {
    /// `cuMemHostRegister`ed; unregistered on drop. Keeps the memory alive meanwhile.
    Registered {
        base: usize,
        ctx: Arc<CudaContext>,
        _pool: Option<Arc<Pool>>,
        _slot: Option<Arc<Slot>>,
    },
    /// Registration failed (why); parts in this range go through a `cuMemHostAlloc` buffer.
    Failed(String),
}

impl Drop for Pin {
    fn drop(&mut self) {
        if let Pin::Registered { base, ctx, .. } = self {
            if ctx.bind_to_thread().is_err() {
                return;
            }
            // SAFETY: `base` was registered by `Gpu::pin_range` in this context and is still
            // mapped (this pin holds its owner).
            let r = unsafe { sys::cuMemHostUnregister(*base as *mut std::ffi::c_void) };
            if r != CUresult::CUDA_SUCCESS {
                tracing::warn!(code = ?r, "cuMemHostUnregister failed");
            }
        }
    }
}

/// One CUDA device with a copy stream, and the host memory it has page-locked for the
/// staging path. Open it once per process and pass it to the `*_device` calls.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// By range start: pools (by pool base) and heap slots (by slot address).
    pins: Mutex<HashMap<usize, Pin>>,
    /// `cuMemHostAlloc` bounce buffers for parts whose memory could not be registered,
    /// by slot address; reused across steps like the slots.
    bounce: Mutex<HashMap<usize, Arc<Mutex<PinnedHostSlice<f32>>>>>,
    paths: GpuPaths,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ctx.ordinal())
            .field("paths", &self.paths)
            .finish()
    }
}

/// Number of CUDA devices, or the typed reason there are none (no driver, no device).
pub fn device_count() -> Result<usize, WorkerError> {
    probe_driver()?;
    match CudaContext::device_count() {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        Err(e) => Err(driver_err("cuDeviceGetCount", e, 0)),
    }
}

impl Gpu {
    /// Opens device `ordinal`: loads the driver (a typed error, never a panic, when it is
    /// missing), retains the primary context, creates the copy stream and detects which
    /// transfer paths the device allows (logged once).
    pub fn open(ordinal: usize) -> Result<Gpu, WorkerError> {
        let count = device_count()?;
        if count == 0 {
            return Err(WorkerError::NoCudaDevice {
                detail: "the driver reports 0 devices".into(),
            });
        }
        if ordinal >= count {
            return Err(WorkerError::NoCudaDevice {
                detail: format!("device {ordinal} asked for, {count} present"),
            });
        }
        // cudarc panics on symbols the probe did not foresee; keep that an error.
        let opened = std::panic::catch_unwind(|| -> Result<_, WorkerError> {
            let ctx = CudaContext::new(ordinal)
                .map_err(|e| driver_err("cuDevicePrimaryCtxRetain", e, 0))?;
            let stream = ctx
                .new_stream()
                .map_err(|e| driver_err("cuStreamCreate", e, 0))?;
            let name = ctx
                .name()
                .map_err(|e| driver_err("cuDeviceGetName", e, 0))?;
            Ok((ctx, stream, name))
        })
        .map_err(|p| WorkerError::Cuda {
            op: "open device".into(),
            code: panic_text(&p),
        })?;
        let (ctx, stream, name) = opened?;
        let paths = detect_paths(&ctx, name);
        tracing::info!(device = %paths.device, gpudirect = ?paths.gpudirect_rdma, ipc = ?paths.cuda_ipc, "CUDA device opened");
        Ok(Gpu {
            ctx,
            stream,
            pins: Mutex::default(),
            bounce: Mutex::default(),
            paths,
        })
    }

    /// The context (to allocate device tensors in).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The copy stream the staging path uses.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A zeroed device tensor of `len` f32 on the copy stream; out of memory is
    /// [`WorkerError::CudaOutOfMemory`].
    pub fn alloc_zeros(&self, len: usize) -> Result<CudaSlice<f32>, WorkerError> {
        let bytes = len
            .checked_mul(4)
            .ok_or_else(|| WorkerError::Usage(format!("{len} f32 overflow usize bytes")))?;
        self.stream
            .alloc_zeros::<f32>(len)
            .map_err(|e| driver_err("cuMemAlloc", e, bytes))
    }

    /// A device tensor holding `values`.
    pub fn upload(&self, values: &[f32]) -> Result<CudaSlice<f32>, WorkerError> {
        self.stream
            .clone_htod(values)
            .map_err(|e| driver_err("cuMemcpyHtoD", e, values.len() * 4))
    }

    /// The values of a device tensor (waits for the copy).
    pub fn download(&self, t: &CudaSlice<f32>) -> Result<Vec<f32>, WorkerError> {
        self.stream
            .clone_dtoh(t)
            .map_err(|e| driver_err("cuMemcpyDtoH", e, t.len() * 4))
    }

    /// Transfer paths beyond staging, and why they are not used.
    pub fn paths(&self) -> &GpuPaths {
        &self.paths
    }

    /// How each page-locked host range was pinned: `(range start, None)` when registered
    /// with `cuMemHostRegister`, `(start, Some(reason))` when it fell back to
    /// `cuMemHostAlloc` bounce buffers.
    pub fn pinning(&self) -> Vec<(usize, Option<String>)> {
        let pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        pins.iter()
            .map(|(k, p)| match p {
                Pin::Registered { .. } => (*k, None),
                Pin::Failed(why) => (*k, Some(why.clone())),
            })
            .collect()
    }

    /// Page-locks the memory behind `slot` (its whole pool once, or the slot itself);
    /// returns `false` when it must go through a bounce buffer.
    fn pin(&self, slot: &Arc<Slot>, pool: Option<Arc<Pool>>) -> bool {
        let addr = slot.as_ptr() as usize;
        let pool = pool.filter(|p| {
            p.offset_of(slot.as_ptr().cast::<u8>(), slot.len() * 4)
                .is_some()
        });
        let (key, len) = match &pool {
            Some(p) => (p.base() as usize, p.size()),
            None => (addr, slot.len() * 4),
        };
        let mut pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        let pin = pins.entry(key).or_insert_with(|| {
            if let Err(e) = self.ctx.bind_to_thread() {
                return Pin::Failed(format!("binding the context: {:?}", e.0));
            }
            // SAFETY: `key..key+len` is a live host range (the pool's mapping or the slot's
            // buffer), kept alive by the `Pin` that owns a reference to it until it is
            // unregistered.
            let r = unsafe {
                sys::cuMemHostRegister_v2(
                    key as *mut std::ffi::c_void,
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            };
            if r == CUresult::CUDA_SUCCESS {
                let (_pool, _slot) = match pool {
                    Some(p) => (Some(p), None),
                    None => (None, Some(slot.clone())),
                };
                Pin::Registered {
                    base: key,
                    ctx: self.ctx.clone(),
                    _pool,
                    _slot,
                }
            } else {
                let why = format!(
                    "cuMemHostRegister of {len} B at {key:#x} ({}) failed with {r:?}",
                    if pool.is_some() {
                        "transport pool"
                    } else {
                        "heap staging buffer"
                    }
                );
                tracing::warn!(%why, "staging through cuMemHostAlloc bounce buffers instead");
                Pin::Failed(why)
            }
        });
        matches!(pin, Pin::Registered { .. })
    }

    /// The bounce buffer for `slot`, allocated on first use.
    fn bounce_for(&self, slot: &Slot) -> Result<Arc<Mutex<PinnedHostSlice<f32>>>, WorkerError> {
        let mut b = self.bounce.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(buf) = b.get(&(slot.as_ptr() as usize)) {
            return Ok(buf.clone());
        }
        // SAFETY: the contents are uninitialised until the device-to-host copy fills them;
        // nothing reads them before (see `device_push`). Flags 0: cached memory, since
        // the CPU reads it back (write-combined memory would make that slow).
        let buf = unsafe { self.ctx.alloc_pinned_with_flags::<f32>(slot.len(), 0) }
            .map_err(|e| driver_err("cuMemHostAlloc", e, slot.len() * 4))?;
        let buf = Arc::new(Mutex::new(buf));
        b.insert(slot.as_ptr() as usize, buf.clone());
        Ok(buf)
    }
}

/// Detects GPUDirect RDMA (DMA-BUF) and CUDA IPC support; both are reported, not used.
fn detect_paths(ctx: &Arc<CudaContext>, device: String) -> GpuPaths {
    use sys::CUdevice_attribute as A;
    let attr = |a: A| ctx.attribute(a).unwrap_or(0);
    let gdr = attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED) == 1;
    let dmabuf = attr(A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) == 1
        && has_symbol("cuMemGetHandleForAddressRange");
    let gpudirect_rdma = Err(match (gdr, dmabuf) {
        (true, true) => "the device supports GPUDirect RDMA with DMA-BUF export, but registering device memory \
                         with the NIC (ibv_reg_dmabuf_mr) is not implemented in the Ibex verbs provider; staging"
            .to_string(),
        (true, false) => "the device supports GPUDirect RDMA but not DMA-BUF export \
                          (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0 or the driver lacks cuMemGetHandleForAddressRange); \
                          staging"
            .to_string(),
        _ => "the device does not support GPUDirect RDMA; staging".to_string(),
    });
    let unified =
        attr(A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING) == 1 && has_symbol("cuIpcGetMemHandle");
    let cuda_ipc = Err(if unified {
        "the device supports CUDA IPC, but the PS holds its variables in host memory (ibex-ps has no GPU \
         storage), so there is no GPU peer to map; staging"
            .to_string()
    } else {
        "the device does not support CUDA IPC (no unified addressing); staging".to_string()
    });
    GpuPaths {
        device,
        gpudirect_rdma,
        cuda_ipc,
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic inside cudarc".to_string())
}

/// The order in which per-PS copy groups are enqueued: smallest first (ties by PS), so the
/// first request leaves as early as possible and later, larger copies overlap the sends.
pub(crate) fn plan_groups(bytes_per_group: &[usize]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..bytes_per_group.len()).collect();
    order.sort_by_key(|&i| (bytes_per_group[i], i));
    order
}

/// Waits for `ev` without blocking the runtime thread.
async fn wait_event(ev: &CudaEvent) -> Result<(), WorkerError> {
    let mut spins = 0u32;
    loop {
        match ev.try_is_complete() {
            Ok(true) => return Ok(()),
            Ok(false) if spins < 64 => {
                spins += 1;
                tokio::task::yield_now().await;
            }
            Ok(false) => tokio::time::sleep(Duration::from_micros(50)).await,
            Err(e) => return Err(driver_err("cuEventQuery", e, 0)),
        }
    }
}

/// One PS's device-to-host copies: (variable, part) indices into the lease, total bytes.
struct CopyGroup {
    ps: usize,
    parts: Vec<(usize, usize)>,
    bytes: usize,
}

/// Per part of a staged push: where the device-to-host copy landed when it went through a
/// bounce buffer, to be moved into the slot once the group's event completed.
struct Bounced {
    slot: Arc<Slot>,
    buf: Arc<Mutex<PinnedHostSlice<f32>>>,
}

impl Worker {
    /// [`Worker::push`] for gradients in device memory: copied device-to-host into the
    /// registered buffers (pinned), each PS's request sent as soon as its copies are done.
    pub async fn push_device(
        &self,
        gpu: &Gpu,
        step: u64,
        grads: &[(&str, &CudaSlice<f32>)],
    ) -> Result<(), WorkerError> {
        self.device_push(gpu, step, grads, false).await.map(drop)
    }

    /// [`Worker::push_pull`] for device tensors: pushes `grads` as [`Worker::push_device`]
    /// does, then writes the fresh values into `params` (same order) host-to-device.
    pub async fn push_pull_device(
        &self,
        gpu: &Gpu,
        step: u64,
        grads: &[(&str, &CudaSlice<f32>)],
        params: &mut [&mut CudaSlice<f32>],
    ) -> Result<(), WorkerError> {
        if params.len() != grads.len() {
            return Err(WorkerError::Usage(format!(
                "push_pull_device got {} gradients but {} parameter buffers",
                grads.len(),
                params.len()
            )));
        }
        let names: Vec<&str> = grads.iter().map(|(n, _)| *n).collect();
        let fresh = self.device_push(gpu, step, grads, true).await?;
        upload(gpu, &names, &fresh, params).await
    }

    /// [`Worker::pull`] into device tensors (host-to-device on the copy stream).
    pub async fn pull_device(
        &self,
        gpu: &Gpu,
        names: &[&str],
        step: u64,
        params: &mut [&mut CudaSlice<f32>],
    ) -> Result<(), WorkerError> {
        if params.len() != names.len() {
            return Err(WorkerError::Usage(format!(
                "pull_device got {} names but {} parameter buffers",
                names.len(),
                params.len()
            )));
        }
        let fresh = self.pull(names, step).await?;
        upload(gpu, names, &fresh, params).await
    }

    async fn device_push(
        &self,
        gpu: &Gpu,
        step: u64,
        grads: &[(&str, &CudaSlice<f32>)],
        pull: bool,
    ) -> Result<Vec<Vec<f32>>, WorkerError> {
        let names: Vec<&str> = grads.iter().map(|(n, _)| *n).collect();
        // Sizes first: cudarc asserts on mismatched copies.
        for (p, (name, g)) in self.lookup(names.iter().copied())?.iter().zip(grads) {
            if g.len() != p.spec.numel() {
                return Err(WorkerError::ShapeMismatch {
                    name: name.to_string(),
                    expected: p.spec.numel(),
                    got: g.len(),
                });
            }
        }
        let staged = self.stage(&names).await?;
        // Per PS: the parts to copy (variable index, part index).
        let mut groups: Vec<CopyGroup> = Vec::new();
        for (vi, v) in staged.vars().iter().enumerate() {
            for (pi, part) in v.placement.parts.iter().enumerate() {
                let bytes = v.parts[pi].len() * 4;
                match groups.iter_mut().find(|g| g.ps == part.ps) {
                    Some(g) => {
                        g.parts.push((vi, pi));
                        g.bytes += bytes;
                    }
                    None => groups.push(CopyGroup {
                        ps: part.ps,
                        parts: vec![(vi, pi)],
                        bytes,
                    }),
                }
            }
        }
        let order = plan_groups(&groups.iter().map(|g| g.bytes).collect::<Vec<_>>());
        let mut events: HashMap<usize, (CudaEvent, Vec<Bounced>)> = HashMap::new();
        // Until each group's copies are known complete, a failure must not release the
        // leases (the next `stage` could hand out a buffer the GPU is still writing): the
        // guard waits for the stream first.
        let enqueued = StreamGuard::new(&gpu.stream);
        gpu.ctx
            .bind_to_thread()
            .map_err(|e| driver_err("cuCtxSetCurrent", e, 0))?;
        for gi in order {
            let CopyGroup { ps, parts, bytes } = &groups[gi];
            let pool = self.clients[*ps].ch.connection().and_then(|c| c.pool());
            let mut bounced = Vec::new();
            for &(vi, pi) in parts {
                let v = &staged.vars()[vi];
                let slot = &v.parts[pi];
                let part = &v.placement.parts[pi];
                let row = v.placement.row_len();
                if slot.len() == 0 {
                    // Nothing to copy, and zero-byte registrations or pinned allocations
                    // are errors (or null pointers) in the driver.
                    continue;
                }
                let src = grads[vi]
                    .1
                    .slice(part.row_offset * row..(part.row_offset + part.rows) * row);
                if gpu.pin(slot, pool.clone()) {
                    // SAFETY: the staging lease (`staged`) holds the slot exclusively until
                    // the group's event has completed and the slot is handed to the transport;
                    // the memory is page-locked, so the copy is truly asynchronous.
                    let dst = unsafe { std::slice::from_raw_parts_mut(slot.as_ptr(), slot.len()) };
                    gpu.stream
                        .memcpy_dtoh(&src, dst)
                        .map_err(|e| driver_err("cuMemcpyDtoHAsync", e, 0))?;
                } else {
                    let buf = gpu.bounce_for(slot)?;
                    {
                        let mut b = buf.lock().unwrap_or_else(|e| e.into_inner());
                        gpu.stream
                            .memcpy_dtoh(&src, &mut *b)
                            .map_err(|e| driver_err("cuMemcpyDtoHAsync", e, 0))?;
                    }
                    bounced.push(Bounced {
                        slot: slot.clone(),
                        buf,
                    });
                }
            }
            let ev = gpu
                .stream
                .record_event(None)
                .map_err(|e| driver_err("cuEventRecord", e, *bytes))?;
            events.insert(*ps, (ev, bounced));
        }
        enqueued.disarm();
        let events = &events;
        let stream = &gpu.stream;
        let mut fresh = vec![Vec::new(); if pull { names.len() } else { 0 }];
        let out = pull.then_some(crate::client::Out::Vecs(&mut fresh[..]));
        self.push_staged_when(step, staged, out, |ps| async move {
            let Some((ev, bounced)) = events.get(&ps) else {
                return Ok(());
            };
            // Dropped on an error or when the push is cancelled (then this group's lease is
            // released right after): waits for the copies first.
            let waiting = StreamGuard::new(stream);
            wait_event(ev).await?;
            for b in bounced {
                let buf = b.buf.lock().unwrap_or_else(|e| e.into_inner());
                let host = buf
                    .as_slice()
                    .map_err(|e| driver_err("cuEventSynchronize", e, 0))?;
                // SAFETY: the slot is still leased by this push (the group has not handed
                // it to the transport yet), so nothing else reads or writes it.
                let dst = unsafe { std::slice::from_raw_parts_mut(b.slot.as_ptr(), b.slot.len()) };
                dst.copy_from_slice(&host[..dst.len()]);
            }
            waiting.disarm();
            Ok(())
        })
        .await?;
        Ok(fresh)
    }
}

/// Synchronizes a stream when dropped armed: on error and cancellation paths, so that
/// buffers the stream still copies into are not released before the copies finished.
struct StreamGuard<'a> {
    stream: &'a CudaStream,
    armed: bool,
}

impl<'a> StreamGuard<'a> {
    fn new(stream: &'a CudaStream) -> Self {
        StreamGuard {
            stream,
            armed: true,
        }
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for StreamGuard<'_> {
    fn drop(&mut self) {
        if self.armed
            && let Err(e) = self.stream.synchronize()
        {
            tracing::warn!(code = ?e.0, "synchronizing the copy stream after a failed push");
        }
    }
}

/// Copies `fresh` (host) into `params` (device) on the copy stream and waits for it.
async fn upload(
    gpu: &Gpu,
    names: &[&str],
    fresh: &[Vec<f32>],
    params: &mut [&mut CudaSlice<f32>],
) -> Result<(), WorkerError> {
    gpu.ctx
        .bind_to_thread()
        .map_err(|e| driver_err("cuCtxSetCurrent", e, 0))?;
    for ((name, v), dst) in names.iter().zip(fresh).zip(params.iter_mut()) {
        if dst.len() != v.len() {
            return Err(WorkerError::ShapeMismatch {
                name: name.to_string(),
                expected: v.len(),
                got: dst.len(),
            });
        }
        gpu.stream
            .memcpy_htod(v.as_slice(), &mut **dst)
            .map_err(|e| driver_err("cuMemcpyHtoDAsync", e, 0))?;
    }
    // The host vectors are pageable: the driver has staged them by the time each call
    // returned, but the device values are ready only once the stream got there.
    let ev = gpu
        .stream
        .record_event(None)
        .map_err(|e| driver_err("cuEventRecord", e, 0))?;
    wait_event(&ev).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_go_smallest_first_ties_by_ps() {
        assert_eq!(
            plan_groups(&[4 << 20, 1 << 20, 4 << 20, 0]),
            vec![3, 1, 0, 2]
        );
        assert_eq!(plan_groups(&[]), Vec::<usize>::new());
    }

    #[test]
    fn driver_errors_map_to_typed_errors_without_calling_the_driver() {
        let oom = driver_err(
            "cuMemAlloc",
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            1 << 30,
        );
        assert!(
            matches!(oom, WorkerError::CudaOutOfMemory { bytes, .. } if bytes == 1 << 30),
            "{oom}"
        );
        assert!(oom.to_string().contains("out of memory"), "{oom}");
        let nodev = driver_err("cuInit", DriverError(CUresult::CUDA_ERROR_NO_DEVICE), 0);
        assert!(matches!(nodev, WorkerError::NoCudaDevice { .. }), "{nodev}");
        let other = driver_err(
            "cuLaunchKernel",
            DriverError(CUresult::CUDA_ERROR_LAUNCH_FAILED),
            0,
        );
        assert!(
            other.to_string().contains("CUDA_ERROR_LAUNCH_FAILED"),
            "{other}"
        );
    }
}
