//! Zero-copy pushes from registered buffers.
//!
//! [`Worker::push`] copies every gradient into a fresh buffer before sending it. A training
//! loop that pushes the same variables every step can instead write its gradients straight
//! into buffers the transport can send without copying: [`Worker::stage`] hands out a
//! [`Staged`] lease on one buffer per part of each variable (a variable split across PS
//! shards has one part per shard, see `placement.rs`), allocated on first use from that
//! part's PS connection pool and reused every step after, as BytePS caches its buffers per
//! key. [`Worker::push_staged`] / [`Worker::push_pull_staged`] send from them:
//!
//! * on a one-sided channel (shm, verbs) a part of at least the channel's `remote_min` goes as a
//!   remote-buffer descriptor; since the buffer lies in the connection's registered pool,
//!   shm sends a pool descriptor that the PS reads through its mapping of that pool, with no
//!   copy on the worker at all;
//! * otherwise the part goes inline, and the protobuf encoder's copy into the request body is
//!   the only one.
//!
//! A buffer is never handed out while the transport may still read it: a push turns the
//! lease into read-only views that the exposure (or the request body) holds until the RPC
//! returned, and [`Worker::stage`] waits until the last view is gone ([`Worker::try_stage`]
//! fails with [`WorkerError::BufferBusy`] instead).
//!
//! When a channel has no registered pool (stock gRPC) or the pool is full, the part's buffer
//! is plain heap memory and [`Worker::staging_info`] says why.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use ibex_transport::RemoteBuf;
use ibex_transport::pool::PoolBufMut;
use tokio::sync::Notify;

use futures_util::future::try_join_all;

use crate::client::{Batches, Out, OutBuf, Worker, check_bufs};
use crate::error::WorkerError;
use crate::pb;
use crate::placement::Placement;

/// The per-worker cache of registered buffers, by variable name.
#[derive(Default)]
pub(crate) struct Cache {
    vars: Mutex<HashMap<String, Arc<VarBufs>>>,
}

/// One variable's buffers, one per part, in part order.
pub(crate) struct VarBufs {
    pub(crate) placement: Placement,
    pub(crate) parts: Vec<Arc<Slot>>,
}

/// Where a part's buffer lives.
enum Mem {
    /// Carved from the PS connection's registered pool.
    Pool(#[allow(dead_code)] PoolBufMut),
    /// Plain heap memory (f32 so it is aligned for the `&mut [f32]` view).
    Heap(#[allow(dead_code)] Box<[f32]>),
}

#[derive(Default)]
struct SlotState {
    /// A [`Staged`] holds it for writing.
    leased: bool,
    /// Read-only views held by the transport (exposures, request bodies).
    views: usize,
}

/// One part's buffer: `len` f32 values at `ptr`, kept alive by `_mem`.
pub(crate) struct Slot {
    ptr: *mut f32,
    len: usize,
    _mem: Mem,
    fallback: Option<String>,
    state: Mutex<SlotState>,
    freed: Notify,
}

// SAFETY: `ptr` points into `_mem`, which the slot owns and which never moves (pool memory
// or a boxed slice). Writes happen only through a `Staged` lease, which `state` makes
// exclusive and which excludes views; reads happen only through views, which exist only
// while no lease does.
unsafe impl Send for Slot {}
// SAFETY: see `Send`; the lease/view protocol is enforced under the `state` mutex.
unsafe impl Sync for Slot {}

impl Slot {
    fn new(conn_pool: Option<&ibex_transport::grpc::Channel>, elems: usize) -> Slot {
        let bytes = elems * 4;
        let (mem, fallback) = match conn_pool {
            None => (
                None,
                Some("stock gRPC channel: no registered pool".to_string()),
            ),
            Some(ch) => match ch
                .connection()
                .ok_or_else(|| ibex_transport::Error::Config("no Ibex connection".into()))
                .and_then(|c| c.alloc(bytes))
            {
                // Pool buffers are 64-byte aligned within a page-aligned region; the check
                // keeps the f32 view sound should that ever change.
                Ok(b) if (b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f32>()) => {
                    (Some(b), None)
                }
                Ok(_) => (
                    None,
                    Some("registered pool buffer is not 4-byte aligned".to_string()),
                ),
                Err(e) => (
                    None,
                    Some(format!("registered pool allocation failed: {e}")),
                ),
            },
        };
        let (ptr, mem) = match mem {
            Some(mut b) => (b.as_mut_ptr().cast::<f32>(), Mem::Pool(b)),
            None => {
                let mut h = vec![0f32; elems].into_boxed_slice();
                (h.as_mut_ptr(), Mem::Heap(h))
            }
        };
        if let Some(why) = &fallback {
            tracing::debug!(elems, %why, "staging buffer in heap memory");
        }
        Slot {
            ptr,
            len: elems,
            _mem: mem,
            fallback,
            state: Mutex::new(SlotState::default()),
            freed: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        // The state is two plain fields updated in single statements: a panic elsewhere
        // cannot leave it inconsistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the write lease if nobody holds it or reads the buffer.
    fn try_lease(&self) -> bool {
        let mut st = self.lock();
        if st.leased || st.views > 0 {
            return false;
        }
        st.leased = true;
        true
    }

    fn is_free(&self) -> bool {
        let st = self.lock();
        !st.leased && st.views == 0
    }

    fn unlease(&self) {
        self.lock().leased = false;
        self.freed.notify_waiters();
    }

    /// Ends the lease and returns a read-only view for the transport; the buffer is free
    /// again once every view is dropped.
    fn into_view(self: &Arc<Self>) -> Bytes {
        {
            let mut st = self.lock();
            st.leased = false;
            st.views += 1;
        }
        Bytes::from_owner(View(self.clone()))
    }

    /// Start of the buffer (for page-locking it with CUDA).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn as_ptr(&self) -> *mut f32 {
        self.ptr
    }

    /// Elements in the buffer.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer lies in a registered pool (`None`) or why not.
    pub(crate) fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }
}

/// A read-only view of a slot held by the transport.
struct View(Arc<Slot>);

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: views exist only while no lease does (see `Slot`), so nothing writes the
        // buffer while this shared slice lives; the slot keeps the memory alive.
        unsafe { std::slice::from_raw_parts(self.0.ptr.cast::<u8>(), self.0.len * 4) }
    }
}

impl Drop for View {
    fn drop(&mut self) {
        {
            let mut st = self.0.lock();
            st.views -= 1;
        }
        self.0.freed.notify_waiters();
    }
}

/// Where one part's registered buffer lives; see [`Worker::staging_info`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagingInfo {
    /// The part's name on its PS.
    pub part: String,
    /// The PS holding the part.
    pub ps: usize,
    /// Bytes in the buffer.
    pub bytes: usize,
    /// `None` when the buffer lies in the PS connection's registered pool; otherwise why it
    /// is plain heap memory (stock gRPC channel, pool full).
    pub fallback: Option<String>,
}

/// A write lease on the registered gradient buffers of some variables, from
/// [`Worker::stage`]. Write each variable's gradient with [`Staged::var_mut`] (one part) or
/// [`Staged::parts_mut`] (any number of parts), then hand the lease to
/// [`Worker::push_staged`] or [`Worker::push_pull_staged`]. Dropping it unsent releases the
/// buffers. Their contents carry over from the last step: overwrite every value.
pub struct Staged {
    vars: Vec<Arc<VarBufs>>,
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.vars.iter().map(|v| &v.placement.spec.name))
            .finish()
    }
}

/// One part of a staged variable: its rows of the whole variable and its buffer.
#[derive(Debug)]
pub struct StagedPart<'a> {
    /// First dim-0 row of the whole variable held by this part.
    pub row_offset: usize,
    /// Dim-0 rows in this part.
    pub rows: usize,
    /// The part's values (`rows * row_len` f32), row-major.
    pub values: &'a mut [f32],
}

impl Staged {
    /// Names of the staged variables, in the order given to [`Worker::stage`].
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.vars.iter().map(|v| v.placement.spec.name.as_str())
    }

    fn find(&self, name: &str) -> Result<&Arc<VarBufs>, WorkerError> {
        self.vars
            .iter()
            .find(|v| v.placement.spec.name == name)
            .ok_or_else(|| {
                WorkerError::Usage(format!(
                    "{name:?} is not part of this staging lease: pass it to Worker::stage"
                ))
            })
    }

    /// The whole gradient buffer of `name`, when the variable has a single part (it is not
    /// split across PS shards); otherwise a usage error pointing to [`Staged::parts_mut`].
    pub fn var_mut(&mut self, name: &str) -> Result<&mut [f32], WorkerError> {
        let v = self.find(name)?;
        if v.parts.len() != 1 {
            return Err(WorkerError::Usage(format!(
                "{name:?} is split into {} parts across PS shards: write it with Staged::parts_mut",
                v.parts.len()
            )));
        }
        let slot = &v.parts[0];
        // SAFETY: this lease holds the slot exclusively (no other lease, no views) until it
        // is consumed or dropped, and `&mut self` keeps this the only slice into it.
        Ok(unsafe { std::slice::from_raw_parts_mut(slot.ptr, slot.len) })
    }

    /// Every part of `name` in dim-0 order; concatenated, they are the whole variable.
    pub fn parts_mut(&mut self, name: &str) -> Result<Vec<StagedPart<'_>>, WorkerError> {
        let v = self.find(name)?;
        Ok(v.placement
            .parts
            .iter()
            .zip(&v.parts)
            .map(|(part, slot)| StagedPart {
                row_offset: part.row_offset,
                rows: part.rows,
                // SAFETY: as in `var_mut`; the parts are distinct allocations, so the
                // slices do not overlap.
                values: unsafe { std::slice::from_raw_parts_mut(slot.ptr, slot.len) },
            })
            .collect())
    }

    /// Copies a whole gradient into the parts of `name` (for callers whose gradient already
    /// sits in one slice; writing through [`Staged::parts_mut`] saves this copy).
    pub fn write(&mut self, name: &str, values: &[f32]) -> Result<(), WorkerError> {
        let expected = self.find(name)?.placement.spec.numel();
        if values.len() != expected {
            return Err(WorkerError::ShapeMismatch {
                name: name.to_string(),
                expected,
                got: values.len(),
            });
        }
        let mut at = 0;
        for p in self.parts_mut(name)? {
            let n = p.values.len();
            p.values.copy_from_slice(&values[at..at + n]);
            at += n;
        }
        Ok(())
    }

    /// The staged variables' buffers, for the CUDA path's device-to-host copies.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn vars(&self) -> &[Arc<VarBufs>] {
        &self.vars
    }

    /// Splits the lease by PS: each group's slots stay leased until turned into views.
    fn into_groups(mut self) -> (Vec<Placement>, Vec<Group>) {
        // Taken out so that `Drop` (which runs on the emptied lease) releases nothing: the
        // groups own the leases now.
        let vars = std::mem::take(&mut self.vars);
        let places: Vec<Placement> = vars.iter().map(|v| v.placement.clone()).collect();
        let mut groups: Vec<Group> = Vec::new();
        for v in &vars {
            for (part, slot) in v.placement.parts.iter().zip(&v.parts) {
                let item = (
                    part.name.clone(),
                    v.placement.part_shape(part),
                    slot.clone(),
                );
                match groups.iter_mut().find(|g| g.ps == part.ps) {
                    Some(g) => g.parts.push(item),
                    None => groups.push(Group {
                        ps: part.ps,
                        parts: vec![item],
                    }),
                }
            }
        }
        (places, groups)
    }
}

/// One PS's share of a staged push: part name, shape and leased slot of each part.
pub(crate) struct Group {
    pub(crate) ps: usize,
    pub(crate) parts: Vec<(String, Vec<usize>, Arc<Slot>)>,
}

impl Drop for Group {
    fn drop(&mut self) {
        // Parts not yet handed to the transport (an error before the send) are released.
        for (_, _, slot) in &self.parts {
            slot.unlease();
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for v in &self.vars {
            for slot in &v.parts {
                slot.unlease();
            }
        }
    }
}

impl Worker {
    /// Takes a write lease on the registered gradient buffers of `names` (dense variables
    /// created with `create_variables`), allocating them on first use and reusing them
    /// after. Waits while a buffer is still held by an earlier push the PS may be reading.
    pub async fn stage(&self, names: &[&str]) -> Result<Staged, WorkerError> {
        let vars = self.staging_bufs(names)?;
        loop {
            // Lease all or none, so two callers staging overlapping sets cannot each hold
            // a part of what the other waits for.
            let busy = match lease_all(&vars) {
                Ok(()) => return Ok(Staged { vars }),
                Err(busy) => busy,
            };
            let notified = busy.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !busy.is_free() {
                notified.await;
            }
        }
    }

    /// As [`Worker::stage`], but fails with [`WorkerError::BufferBusy`] at once when a
    /// buffer is still held by a push in flight or by another lease.
    pub fn try_stage(&self, names: &[&str]) -> Result<Staged, WorkerError> {
        let vars = self.staging_bufs(names)?;
        match lease_all(&vars) {
            Ok(()) => Ok(Staged { vars }),
            Err(busy) => {
                let name = vars
                    .iter()
                    .find(|v| v.parts.iter().any(|s| Arc::ptr_eq(s, &busy)))
                    .map(|v| v.placement.spec.name.clone())
                    .unwrap_or_default();
                Err(WorkerError::BufferBusy { name })
            }
        }
    }

    /// Where each part of `name`'s registered buffer lives, once [`Worker::stage`] has
    /// allocated it.
    pub fn staging_info(&self, name: &str) -> Option<Vec<StagingInfo>> {
        let cache = self.staging.vars.lock().unwrap_or_else(|e| e.into_inner());
        let v = cache.get(name)?;
        Some(
            v.placement
                .parts
                .iter()
                .zip(&v.parts)
                .map(|(part, slot)| StagingInfo {
                    part: part.name.clone(),
                    ps: part.ps,
                    bytes: slot.len() * 4,
                    fallback: slot.fallback().map(str::to_string),
                })
                .collect(),
        )
    }

    /// [`Worker::push`] from the registered buffers of `staged`: no copy on the worker for
    /// descriptor-path parts, only the encoder's for inline ones.
    pub async fn push_staged(&self, step: u64, staged: Staged) -> Result<(), WorkerError> {
        self.push_staged_into(step, staged, None).await
    }

    /// [`Worker::push_pull`] from the registered buffers of `staged`; returns the fresh
    /// values of the staged variables in their staging order.
    pub async fn push_pull_staged(
        &self,
        step: u64,
        staged: Staged,
    ) -> Result<Vec<Vec<f32>>, WorkerError> {
        let mut out = vec![Vec::new(); staged.vars.len()];
        self.push_staged_into(step, staged, Some(&mut out)).await?;
        Ok(out)
    }

    /// [`Worker::push_pull_staged`] with the fresh values written into the caller's vectors
    /// (one per staged variable, in staging order), as [`Worker::pull_into`] does.
    pub async fn push_pull_staged_into(
        &self,
        step: u64,
        staged: Staged,
        out: &mut [Vec<f32>],
    ) -> Result<(), WorkerError> {
        if out.len() != staged.vars.len() {
            return Err(WorkerError::Usage(format!(
                "{} variables staged but {} output vectors given: pass one per variable",
                staged.vars.len(),
                out.len()
            )));
        }
        self.push_staged_into(step, staged, Some(out)).await
    }

    /// [`Worker::push_pull_staged`] with the fresh values read straight into caller memory
    /// (one buffer per staged variable, in staging order), as [`Worker::pull_into_bufs`]
    /// does.
    pub async fn push_pull_staged_into_bufs(
        &self,
        step: u64,
        staged: Staged,
        out: &[OutBuf],
    ) -> Result<(), WorkerError> {
        let names: Vec<String> = staged.names().map(str::to_string).collect();
        check_bufs(self, names.iter().map(String::as_str), out)?;
        self.push_staged_when(step, staged, Some(Out::Bufs(out)), |_| async { Ok(()) })
            .await
    }

    /// A staged push; with `out`, a push-pull whose fresh values land there.
    pub(crate) async fn push_staged_into(
        &self,
        step: u64,
        staged: Staged,
        out: Option<&mut [Vec<f32>]>,
    ) -> Result<(), WorkerError> {
        self.push_staged_when(step, staged, out.map(Out::Vecs), |_| async { Ok(()) })
            .await
    }

    /// A lease on the buffers of `grads`' variables with each gradient copied in: the one
    /// copy a caller holding slices pays. Waits as [`Worker::stage`] does.
    pub async fn stage_copied(&self, grads: &[(&str, &[f32])]) -> Result<Staged, WorkerError> {
        self.stage_slices(grads).await
    }

    /// See [`Worker::stage_copied`].
    pub(crate) async fn stage_slices(
        &self,
        grads: &[(&str, &[f32])],
    ) -> Result<Staged, WorkerError> {
        let names: Vec<&str> = grads.iter().map(|(n, _)| *n).collect();
        let mut staged = self.stage(&names).await?;
        for (name, g) in grads {
            staged.write(name, g)?;
        }
        Ok(staged)
    }

    /// The cached buffers of `names`, allocating those not yet cached.
    pub(crate) fn staging_bufs(&self, names: &[&str]) -> Result<Vec<Arc<VarBufs>>, WorkerError> {
        let places = self.lookup(names.iter().copied())?;
        let mut cache = self.staging.vars.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<Arc<VarBufs>> = Vec::with_capacity(names.len());
        for p in places {
            let name = p.spec.name.clone();
            if p.spec.sparse {
                return Err(WorkerError::Usage(format!(
                    "{name:?} is a sparse table: use push_sparse"
                )));
            }
            if out.iter().any(|v| v.placement.spec.name == name) {
                return Err(WorkerError::Usage(format!(
                    "variable {name:?} is listed twice"
                )));
            }
            let bufs = cache.entry(name).or_insert_with(|| {
                let row = p.row_len();
                let parts = p
                    .parts
                    .iter()
                    .map(|part| {
                        let ch = self.clients[part.ps].ibex();
                        Arc::new(Slot::new(ch, part.rows * row))
                    })
                    .collect();
                Arc::new(VarBufs {
                    placement: p,
                    parts,
                })
            });
            out.push(bufs.clone());
        }
        Ok(out)
    }

    /// Sends `staged` with one request per PS, each as soon as `ready(ps)` resolves (the
    /// CUDA path resolves it when that PS's device-to-host copies are done, so the copies
    /// for the next PS overlap this send). With `out`, a push-pull: the fresh values are
    /// written there (one vector per staged variable, in staging order).
    pub(crate) async fn push_staged_when<F, Fut>(
        &self,
        step: u64,
        staged: Staged,
        out: Option<Out<'_>>,
        ready: F,
    ) -> Result<(), WorkerError>
    where
        F: Fn(usize) -> Fut,
        Fut: std::future::Future<Output = Result<(), WorkerError>>,
    {
        let (places, groups) = staged.into_groups();
        let worker = self.index;
        let ready = &ready;
        let pull = out.is_some();
        let replies = try_join_all(groups.into_iter().map(|mut g| async move {
            ready(g.ps).await?;
            // Inline tensors fill request bodies; descriptors take next to no room.
            let mut batches: Batches<(pb::Tensor, Option<RemoteBuf>)> = Batches::default();
            while let Some((name, shape, slot)) = g.parts.pop() {
                #[cfg(target_endian = "big")]
                // SAFETY: the group still holds this slot's lease.
                unsafe {
                    for x in std::slice::from_raw_parts_mut(slot.ptr, slot.len) {
                        *x = f32::from_bits(x.to_bits().to_le());
                    }
                }
                let bytes = slot.len() * 4;
                let (t, k) = self
                    .tensor_from_bytes(g.ps, &name, shape, slot.into_view())
                    .await?;
                let body = if k.is_some() { 0 } else { bytes };
                batches.add((t, k), body);
            }
            let replies = try_join_all(batches.done.into_iter().map(|b| {
                let (grads, keep): (Vec<_>, Vec<_>) = b.into_iter().unzip();
                self.send_one(
                    (
                        g.ps,
                        pb::PushRequest {
                            step,
                            worker,
                            grads,
                            release: self.take_released(g.ps),
                        },
                        keep.into_iter().flatten().collect(),
                    ),
                    pull,
                )
            }))
            .await?;
            Ok::<_, WorkerError>(replies.into_iter().flatten().collect::<Vec<_>>())
        }))
        .await?;
        match out {
            Some(out) => {
                self.assemble_out(&places, replies.into_iter().flatten(), out)
                    .await
            }
            None => Ok(()),
        }
    }
}

/// Leases every slot of `vars`, or none: on failure returns the busy slot.
fn lease_all(vars: &[Arc<VarBufs>]) -> Result<(), Arc<Slot>> {
    let slots: Vec<&Arc<Slot>> = vars.iter().flat_map(|v| &v.parts).collect();
    for (i, s) in slots.iter().enumerate() {
        if !s.try_lease() {
            for done in &slots[..i] {
                done.unlease();
            }
            return Err((*s).clone());
        }
    }
    Ok(())
}
