//! One PS shard: its variables, the step counter, and the sync/async step rules.
//!
//! Sync mode: step k is applied once every one of the N workers has pushed a gradient for
//! every variable of the shard at step k; the PS applies the average, once. A push for a
//! step the shard has not reached yet waits for it; a push for an applied step, or a second
//! push of the same variable by the same worker, is FAILED_PRECONDITION. Pulls of step k
//! wait until k steps are applied. Every wait is bounded by the sync timeout and then fails
//! with DEADLINE_EXCEEDED naming the step and the workers that have not pushed.
//!
//! Async mode: each push is applied at once (gradients not averaged) and counts as a step.
//!
//! Locking: each variable has its own mutex, so pushes of different variables (the layers
//! of one step, the shards of a split variable) accumulate and apply at the same time. A
//! variable is applied as soon as its last worker's gradient arrives; the step advances
//! when every variable has been. Lock order: variables (by name), then the step state, then
//! the variable table. All of it runs on blocking threads (`spawn_blocking`), never on a
//! runtime thread, since a lock can be held for a variable's whole optimizer update.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use bytes::Bytes;
use ibex_proto::ps::v1 as pb;
use ibex_transport::PoolBufMut;
use rayon::prelude::*;
use tokio::sync::watch;
use tonic::Status;

use crate::bufs::{Buf, BufPool, F32s};
use crate::checkpoint;
use crate::init;
use crate::optim::{self, Optimizer};

/// How gradients become steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Aggregate all workers' gradients for a step, apply once.
    Sync,
    /// Apply each push as it arrives.
    Async,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "sync" => Ok(Mode::Sync),
            "async" => Ok(Mode::Async),
            o => Err(format!("unknown mode {o:?}: use sync or async")),
        }
    }
}

impl Mode {
    /// "sync" or "async".
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Sync => "sync",
            Mode::Async => "async",
        }
    }
}

/// What a sync step does when a worker has not pushed within the sync timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerLoss {
    /// Fail the waiting calls with DEADLINE_EXCEEDED naming the missing workers (the
    /// default: a sync step is the average over every worker, and going on without one
    /// changes the result, which a job must ask for).
    #[default]
    Fail,
    /// Complete the step with the gradients that came (averaged over the workers that
    /// pushed), and leave the missing workers out of later steps until they push again.
    Continue,
}

impl std::str::FromStr for WorkerLoss {
    type Err = String;
    fn from_str(s: &str) -> Result<WorkerLoss, String> {
        match s {
            "fail" => Ok(WorkerLoss::Fail),
            "continue" => Ok(WorkerLoss::Continue),
            o => Err(format!(
                "unknown worker-loss policy {o:?}: use fail or continue"
            )),
        }
    }
}

impl WorkerLoss {
    /// "fail" or "continue".
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerLoss::Fail => "fail",
            WorkerLoss::Continue => "continue",
        }
    }
}

/// One variable (or partition) with its optimizer state.
#[derive(Debug, Clone)]
pub(crate) struct Var {
    pub def: pb::VariableDef,
    pub optim: Optimizer,
    pub shape: Vec<usize>,
    /// Values in f32, already rounded to the storage dtype.
    pub data: Vec<f32>,
    pub slots: Vec<Vec<f32>>,
    /// Updates applied (Adam's t). For sparse tables: per row, so lazy Adam corrects each
    /// row by the number of times it was updated.
    pub t: Vec<u64>,
}

/// What a definition would cost, checked before any of it is allocated.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Footprint {
    pub elements: u64,
    pub bytes: u64,
}

/// A checked definition: every size derived from the wire, computed without overflow.
struct Plan {
    optim: Optimizer,
    shape: Vec<usize>,
    full: Vec<u64>,
    numel: usize,
    /// Index of the first element in the whole variable (for the initializer).
    first: u64,
    t_len: usize,
    cost: Footprint,
}

impl Plan {
    fn new(def: &pb::VariableDef, limits: &Limits) -> Result<Plan, Status> {
        let bad = |m: String| Status::invalid_argument(format!("variable {:?}: {m}", def.name));
        if def.name.is_empty() {
            return Err(Status::invalid_argument(
                "a variable needs a non-empty name",
            ));
        }
        dtype(def.dtype).map_err(bad)?;
        let optim = Optimizer::from_pb(def.optimizer.as_ref()).map_err(bad)?;
        if def.sparse && def.shape.len() != 2 {
            return Err(bad(format!(
                "a sparse table must be 2-D [rows, dim], got shape {:?}",
                def.shape
            )));
        }
        let numel = numel(&def.shape).ok_or_else(|| {
            bad(format!(
                "shape {:?} is too large: its element count overflows; partition it",
                def.shape
            ))
        })?;
        limits.check_elements(&def.name, numel, 0)?;
        // Rows of a sparse table each carry an update count, even when the rows are empty.
        let rows = def.shape.first().copied().unwrap_or(1);
        let t_len = if def.sparse { rows } else { 1 };
        limits.check_elements(&def.name, t_len, 0)?;
        let full = if def.full_shape.is_empty() {
            def.shape.clone()
        } else {
            def.full_shape.clone()
        };
        if full.len() != def.shape.len() || full.get(1..) != def.shape.get(1..) {
            return Err(bad(format!(
                "partition shape {:?} does not match the full shape {full:?} past dim 0: a partition holds whole rows of the full variable",
                def.shape
            )));
        }
        let full_rows = full.first().copied().unwrap_or(1);
        if def
            .row_offset
            .checked_add(rows)
            .is_none_or(|end| end > full_rows)
        {
            return Err(bad(format!(
                "rows {}..+{rows} lie outside the full shape {full:?}",
                def.row_offset
            )));
        }
        // The full shape's element count bounds the initializer's indices; the rows check
        // above makes `row_offset * row_len + numel` at most this, so nothing below overflows.
        numel_of_rows(&full)
            .and_then(|row_len| full_rows.checked_mul(row_len).map(|_| row_len))
            .ok_or_else(|| bad(format!("full shape {full:?} overflows")))?;
        let row_len = numel_of_rows(&full).unwrap_or(0);
        let first = def.row_offset * row_len;
        let slots = optim.num_slots() as u64;
        let bytes = numel
            .checked_mul(4 * (1 + slots))
            .and_then(|b| b.checked_add(t_len.checked_mul(8)?))
            .ok_or_else(|| bad(format!("shape {:?} overflows in bytes", def.shape)))?;
        let cost = Footprint {
            elements: numel,
            bytes,
        };
        limits.check(&def.name, cost, Footprint::default())?;
        let too_big = |n: u64| {
            bad(format!(
                "{n} elements do not fit this machine's address space"
            ))
        };
        Ok(Plan {
            optim,
            shape: def
                .shape
                .iter()
                .map(|&d| usize::try_from(d).map_err(|_| too_big(d)))
                .collect::<Result<_, _>>()?,
            full,
            numel: usize::try_from(numel).map_err(|_| too_big(numel))?,
            first,
            t_len: usize::try_from(t_len).map_err(|_| too_big(t_len))?,
            cost,
        })
    }
}

/// `n` zeros, or RESOURCE_EXHAUSTED when the memory cannot be had (never an abort).
fn zeros<T: Clone + Default>(what: &str, n: usize) -> Result<Vec<T>, Status> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| {
        Status::resource_exhausted(format!(
            "{what}: cannot allocate {n} elements ({e}); lower the model size or add PS shards"
        ))
    })?;
    v.resize(n, T::default());
    Ok(v)
}

impl Var {
    /// Builds a variable, checking every size against `limits` before allocating.
    pub fn new(def: pb::VariableDef, limits: &Limits) -> Result<Var, Status> {
        let plan = Plan::new(&def, limits)?;
        Var::build(def, plan)
    }

    fn build(def: pb::VariableDef, plan: Plan) -> Result<Var, Status> {
        let what = format!("variable {:?}", def.name);
        let mut data = init::values(def.init.as_ref(), &plan.full, plan.first, plan.numel)
            .map_err(|m| Status::invalid_argument(format!("{what}: {m}")))?;
        round_to(def.dtype, &mut data);
        let slots = (0..plan.optim.num_slots())
            .map(|_| zeros(&what, plan.numel))
            .collect::<Result<_, _>>()?;
        Ok(Var {
            optim: plan.optim,
            shape: plan.shape,
            data,
            slots,
            t: zeros(&what, plan.t_len)?,
            def,
        })
    }

    fn footprint(&self) -> Footprint {
        let n = self.data.len() as u64;
        Footprint {
            elements: n,
            bytes: n * 4 * (1 + self.slots.len() as u64) + self.t.len() as u64 * 8,
        }
    }

    fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    fn apply_dense(&mut self, g: &[f32]) {
        optim::apply(&self.optim, &mut self.data, g, &mut self.slots, self.t[0]);
        self.t[0] += 1;
        round_to(self.def.dtype, &mut self.data);
    }

    /// Applies row gradients; `rows` is sorted and unique.
    fn apply_rows(&mut self, rows: &BTreeMap<u64, Vec<f32>>) {
        let d = self.row_len();
        for (&r, g) in rows {
            let r = r as usize;
            let span = r * d..(r + 1) * d;
            let mut slots: Vec<Vec<f32>> = self
                .slots
                .iter()
                .map(|s| s[span.clone()].to_vec())
                .collect();
            optim::apply(
                &self.optim,
                &mut self.data[span.clone()],
                g,
                &mut slots,
                self.t[r],
            );
            for (s, new) in self.slots.iter_mut().zip(slots) {
                s[span.clone()].copy_from_slice(&new);
            }
            self.t[r] += 1;
            round_to(self.def.dtype, &mut self.data[span]);
        }
    }
}

/// What workers may make one shard hold (`--max-variables`, `--max-elements`,
/// `--max-bytes`). Every size in a `CreateVariables` request is checked against them before
/// anything is allocated; a breach is RESOURCE_EXHAUSTED naming the limit and its setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Variables (or partitions) on the shard.
    pub max_variables: u64,
    /// f32 elements over all variables.
    pub max_elements: u64,
    /// Bytes of values, optimizer slots and update counts over all variables.
    pub max_bytes: u64,
}

impl Default for Limits {
    /// 65536 variables, 2^32 elements (16 GiB of f32), 32 GiB: room for the largest models
    /// the benchmarks use (VGG-16 with Adam is 1.7 GB) many times over, while a hostile
    /// definition is refused before it can take the machine's memory.
    fn default() -> Limits {
        Limits {
            max_variables: 1 << 16,
            max_elements: 1 << 32,
            max_bytes: 32 << 30,
        }
    }
}

impl Limits {
    fn breach(what: String, want: u64, limit: u64, flag: &str) -> Status {
        let key = flag.trim_start_matches("--").replace('-', "_");
        Status::resource_exhausted(format!(
            "{what} would be {want}, over this shard's limit of {limit} ({flag}, `{key}` in the config file): raise it or spread the model over more PS shards"
        ))
    }

    fn check_elements(&self, name: &str, n: u64, held: u64) -> Result<(), Status> {
        let want = held.saturating_add(n);
        if want > self.max_elements {
            return Err(Limits::breach(
                format!("elements on the shard with variable {name:?}"),
                want,
                self.max_elements,
                "--max-elements",
            ));
        }
        Ok(())
    }

    /// Checks holding `add` on top of `held`.
    fn check(&self, name: &str, add: Footprint, held: Footprint) -> Result<(), Status> {
        self.check_elements(name, add.elements, held.elements)?;
        let want = held.bytes.saturating_add(add.bytes);
        if want > self.max_bytes {
            return Err(Limits::breach(
                format!("bytes on the shard with variable {name:?}"),
                want,
                self.max_bytes,
                "--max-bytes",
            ));
        }
        Ok(())
    }

    fn check_count(&self, want: u64) -> Result<(), Status> {
        if want > self.max_variables {
            return Err(Limits::breach(
                "variables on the shard".to_string(),
                want,
                self.max_variables,
                "--max-variables",
            ));
        }
        Ok(())
    }
}

/// Element count of `shape`, `None` on overflow (shapes come from the network).
pub(crate) fn numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
}

fn numel_of_rows(shape: &[u64]) -> Option<u64> {
    numel(shape.get(1..).unwrap_or(&[]))
}

pub(crate) fn dtype(d: i32) -> Result<pb::Dtype, String> {
    match pb::Dtype::try_from(d) {
        Ok(pb::Dtype::Unspecified) | Err(_) => {
            Err(format!("dtype {d} is not one of F32, F16, BF16"))
        }
        Ok(t) => Ok(t),
    }
}

/// Rounds values to what the storage dtype can hold, so the PS computes exactly as if it
/// stored f16/bf16 (memory stays f32).
fn round_to(d: i32, v: &mut [f32]) {
    match pb::Dtype::try_from(d) {
        Ok(pb::Dtype::F16) => v
            .iter_mut()
            .for_each(|x| *x = half::f16::from_f32(*x).to_f32()),
        Ok(pb::Dtype::Bf16) => v
            .iter_mut()
            .for_each(|x| *x = half::bf16::from_f32(*x).to_f32()),
        _ => {}
    }
}

/// A gradient for one variable as it arrived (checked against the variable by
/// [`Shard::push`]).
#[derive(Debug)]
pub enum Grad {
    /// A whole dense gradient.
    Dense {
        /// Variable name on this shard.
        name: String,
        /// One value per element.
        values: F32s,
    },
    /// Row gradients of a sparse table.
    Sparse {
        /// Table name on this shard.
        name: String,
        /// Row ids (duplicates are summed).
        ids: Vec<u64>,
        /// `ids.len() * dim` values.
        values: F32s,
    },
}

impl Grad {
    fn name(&self) -> &str {
        match self {
            Grad::Dense { name, .. } | Grad::Sparse { name, .. } => name,
        }
    }
}

/// What the current sync step has collected for one variable.
#[derive(Default)]
struct Pending {
    /// The sum of the dense gradients so far: the first one's buffer, others added into it.
    sum: Option<Buf>,
    rows: BTreeMap<u64, Vec<f32>>,
    workers: BTreeSet<u32>,
}

/// One variable's mutable state, behind its own lock.
struct VarState {
    var: Var,
    /// Sync steps applied to this variable: the shard's step, or one more while the other
    /// variables of that step are still collecting.
    applied: u64,
    pending: Pending,
    /// The values as last read, shared by every pull until the next update: workers
    /// pulling the same step get the same immutable buffer, copied once, not once each.
    snap: Option<Bytes>,
}

/// A variable's table entry: what never changes outside the lock, the rest inside.
struct Cell {
    def: pb::VariableDef,
    shape: Vec<usize>,
    numel: usize,
    state: Mutex<VarState>,
}

impl Cell {
    fn new(var: Var, applied: u64) -> Arc<Cell> {
        Arc::new(Cell {
            def: var.def.clone(),
            shape: var.shape.clone(),
            numel: var.data.len(),
            state: Mutex::new(VarState {
                var,
                applied,
                pending: Pending::default(),
                snap: None,
            }),
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, VarState>, Status> {
        self.state.lock().map_err(|_| poisoned())
    }

    fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }
}

/// The step counter and what completes it.
struct Steps {
    step: u64,
    /// Variables applied for the current sync step.
    done: usize,
    /// Bumped by `restore`: a push that began before it must not count into the new state.
    epoch: u64,
    held: Footprint,
    /// Workers left out of sync steps after they missed one ([`WorkerLoss::Continue`]);
    /// a worker's next push takes it back in.
    lost: BTreeSet<u32>,
}

/// One variable's name, shape and values (little-endian f32 bytes), as read.
pub type Values = (String, Vec<usize>, Bytes);

/// `src` as little-endian bytes into `dst` (exactly `4 * src.len()` long): one memcpy on
/// little-endian machines.
fn copy_le(dst: &mut [u8], src: &[f32]) {
    #[cfg(target_endian = "little")]
    dst.copy_from_slice(bytemuck::cast_slice(src));
    #[cfg(target_endian = "big")]
    for (d, x) in dst.chunks_exact_mut(4).zip(src) {
        d.copy_from_slice(&x.to_le_bytes());
    }
}

/// Shard-wide settings.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    /// This shard's index.
    pub shard: u32,
    /// Workers that take part in each sync step.
    pub num_workers: u32,
    /// Sync or async.
    pub mode: Mode,
    /// How long a sync push or pull waits for the other workers.
    pub sync_timeout: Duration,
    /// Where checkpoints go; none disables them.
    pub checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint after every K-th applied step (0: only on request and shutdown).
    pub checkpoint_every: u64,
    /// What workers may make this shard hold.
    pub limits: Limits,
    /// What a sync step does when a worker does not push within the sync timeout.
    pub on_worker_loss: WorkerLoss,
}

/// Idle gradient and value buffers kept for the next step: a few steps' worth of a large
/// model's tensors; above it buffers go back to the allocator.
const IDLE_BUFFER_BYTES: usize = 2 << 30;

/// The shard's state and its step notifications.
pub struct Shard {
    pub(crate) cfg: ShardConfig,
    vars: RwLock<BTreeMap<String, Arc<Cell>>>,
    steps: Mutex<Steps>,
    step_tx: watch::Sender<u64>,
    pub(crate) bufs: Arc<BufPool>,
}

fn poisoned() -> Status {
    Status::internal(
        "the shard's state lock is poisoned by an earlier panic; restart the PS with --restore",
    )
}

/// Runs `f` on tokio's blocking threads: it may wait on a variable's lock for a whole
/// optimizer update, which must not stall a runtime thread.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("shard task failed: {e}")))?
}

impl Shard {
    /// An empty shard at step 0.
    pub fn new(cfg: ShardConfig) -> Shard {
        let (step_tx, _) = watch::channel(0);
        Shard {
            cfg,
            vars: RwLock::new(BTreeMap::new()),
            steps: Mutex::new(Steps {
                step: 0,
                done: 0,
                epoch: 0,
                held: Footprint::default(),
                lost: BTreeSet::new(),
            }),
            step_tx,
            bufs: BufPool::new(IDLE_BUFFER_BYTES),
        }
    }

    fn steps(&self) -> Result<MutexGuard<'_, Steps>, Status> {
        self.steps.lock().map_err(|_| poisoned())
    }

    fn table(&self) -> Result<std::sync::RwLockReadGuard<'_, BTreeMap<String, Arc<Cell>>>, Status> {
        self.vars.read().map_err(|_| poisoned())
    }

    fn cell(&self, name: &str) -> Result<Arc<Cell>, Status> {
        self.table()?
            .get(name)
            .cloned()
            .ok_or_else(|| unknown(name, self.cfg.shard))
    }

    /// Steps applied so far.
    pub fn step(&self) -> u64 {
        *self.step_tx.borrow()
    }

    /// Shape and whether it is a sparse table, for checking a tensor before it is read.
    pub fn shape_of(&self, name: &str) -> Result<(Vec<u64>, bool), Status> {
        let c = self.cell(name)?;
        Ok((c.def.shape.clone(), c.def.sparse))
    }

    /// Creates variables; returns how many were new. Sizes are checked against the limits
    /// before any memory is allocated.
    pub fn create(&self, defs: Vec<pb::VariableDef>) -> Result<u32, Status> {
        let limits = &self.cfg.limits;
        limits.check_count(defs.len() as u64)?;
        // Held for the whole creation: the totals checked are the totals committed.
        let mut steps = self.steps()?;
        let mut fresh: Vec<(pb::VariableDef, Plan)> = Vec::new();
        let mut reserved = Footprint::default();
        {
            let table = self.table()?;
            for d in defs {
                let same = |old: &pb::VariableDef| {
                    if *old == d {
                        Ok(true)
                    } else if old.name == d.name {
                        Err(Status::already_exists(format!(
                            "variable {:?} exists with a different definition (dtype, shape, initializer or optimizer)",
                            d.name
                        )))
                    } else {
                        Ok(false)
                    }
                };
                if let Some(old) = table.get(&d.name)
                    && same(&old.def)?
                {
                    continue;
                }
                let mut dup = false;
                for (f, _) in &fresh {
                    dup |= same(f)?;
                }
                if dup {
                    continue;
                }
                let plan = Plan::new(&d, limits)?;
                let with = Footprint {
                    elements: steps.held.elements + reserved.elements,
                    bytes: steps.held.bytes + reserved.bytes,
                };
                limits.check(&d.name, plan.cost, with)?;
                limits.check_count(table.len() as u64 + fresh.len() as u64 + 1)?;
                reserved.elements += plan.cost.elements;
                reserved.bytes += plan.cost.bytes;
                fresh.push((d, plan));
            }
        }
        steps.held.elements += reserved.elements;
        steps.held.bytes += reserved.bytes;
        let mut built = Vec::with_capacity(fresh.len());
        for (d, plan) in fresh {
            match Var::build(d, plan) {
                Ok(v) => built.push(v),
                Err(e) => {
                    // Nothing was inserted: give back all of this request's reservation.
                    steps.held.elements -= reserved.elements;
                    steps.held.bytes -= reserved.bytes;
                    return Err(e);
                }
            }
        }
        let mut table = self.vars.write().map_err(|_| poisoned())?;
        let created = built.len() as u32;
        for v in built {
            table.insert(v.def.name.clone(), Cell::new(v, steps.step));
        }
        Ok(created)
    }

    fn check_worker(&self, worker: u32) -> Result<(), Status> {
        if worker >= self.cfg.num_workers {
            return Err(Status::invalid_argument(format!(
                "worker index {worker} is out of range: this PS was started with --num-workers {}",
                self.cfg.num_workers
            )));
        }
        Ok(())
    }

    /// Waits (sync mode) until at least `step` steps are applied.
    pub async fn wait_for(self: &Arc<Self>, step: u64) -> Result<(), Status> {
        if self.cfg.mode == Mode::Async {
            return Ok(());
        }
        let mut rx = self.step_tx.subscribe();
        loop {
            // The watch's guard is dropped here, before anything below awaits.
            let waited = tokio::time::timeout(self.cfg.sync_timeout, rx.wait_for(|s| *s >= step))
                .await
                .map(|r| r.map(|_| ()));
            match waited {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(_)) => return Err(Status::unavailable("the PS is shutting down")),
                Err(_) if self.cfg.on_worker_loss == WorkerLoss::Continue => {
                    let now = self.step();
                    let me = self.clone();
                    if !blocking(move || me.complete_without_missing(now)).await? {
                        return Err(self.timeout_status(step));
                    }
                }
                Err(_) => return Err(self.timeout_status(step)),
            }
        }
    }

    /// [`WorkerLoss::Continue`]: completes sync step `now`, whose wait timed out, with the
    /// gradients that came, each variable averaged over the workers that pushed it, and
    /// leaves the workers that did not push out of later steps. Returns false when nobody
    /// pushed anything for the step (there is nothing to complete it with), true when it
    /// is complete (here or by another caller meanwhile).
    fn complete_without_missing(&self, now: u64) -> Result<bool, Status> {
        let epoch = {
            let s = self.steps()?;
            if s.step != now {
                return Ok(true);
            }
            s.epoch
        };
        // Name order, as every push locks them.
        let cells: Vec<Arc<Cell>> = self.table()?.values().cloned().collect();
        let mut guards = cells
            .iter()
            .map(|c| c.lock())
            .collect::<Result<Vec<_>, _>>()?;
        let open = |st: &VarState| st.applied == now;
        if !guards
            .iter()
            .any(|st| open(st) && !st.pending.workers.is_empty())
        {
            return Ok(false);
        }
        let mut missing = BTreeSet::new();
        {
            let s = self.steps()?;
            if s.epoch != epoch || s.step != now {
                return Ok(true);
            }
            for st in guards.iter().filter(|st| open(st)) {
                for w in 0..self.cfg.num_workers {
                    if !st.pending.workers.contains(&w) && !s.lost.contains(&w) {
                        missing.insert(w);
                    }
                }
            }
        }
        for st in guards.iter_mut() {
            let st: &mut VarState = st;
            if !open(st) {
                continue;
            }
            let p = std::mem::take(&mut st.pending);
            let scale = 1.0 / p.workers.len().max(1) as f32;
            match (p.sum, p.workers.is_empty()) {
                // Nobody still in the step pushed this one: it keeps its values.
                (_, true) => st.applied += 1,
                (Some(sum), false) => Ready::Dense(F32s::Buf(sum)).apply(st, scale, &self.bufs)?,
                (None, false) => Ready::Rows(p.rows).apply(st, scale, &self.bufs)?,
            }
        }
        let next = {
            let mut s = self.steps()?;
            if s.epoch != epoch {
                return Err(Status::aborted(format!(
                    "shard {} was restored from a checkpoint while step {now} was completed without workers {missing:?}",
                    self.cfg.shard
                )));
            }
            s.lost.extend(missing.iter().copied());
            s.done = 0;
            s.step = now + 1;
            s.step
        };
        drop(guards);
        eprintln!(
            "ibex-ps shard {}: step {now} completed without workers {:?} (no push within {:?}); they rejoin with their next push",
            self.cfg.shard,
            missing.iter().collect::<Vec<_>>(),
            self.cfg.sync_timeout
        );
        if self.cfg.checkpoint_every > 0
            && next % self.cfg.checkpoint_every == 0
            && self.cfg.checkpoint_dir.is_some()
        {
            self.save_blocking()?;
        }
        self.step_tx.send_replace(next);
        Ok(true)
    }

    fn timeout_status(&self, wanted: u64) -> Status {
        let step = self.step();
        let cells: Vec<Arc<Cell>> = match self.table() {
            Ok(t) => t.values().cloned().collect(),
            Err(e) => return e,
        };
        let mut missing = BTreeSet::new();
        for c in cells {
            // A variable being updated right now has all its gradients: skip it rather
            // than wait for its lock on a runtime thread.
            let Ok(st) = c.state.try_lock() else { continue };
            if st.applied > step {
                continue;
            }
            for w in 0..self.cfg.num_workers {
                if !st.pending.workers.contains(&w) {
                    missing.insert(w);
                }
            }
        }
        Status::deadline_exceeded(format!(
            "waiting for step {wanted}: step {step} has not been applied after {:?}: workers {:?} have not pushed all variables of shard {} for it",
            self.cfg.sync_timeout,
            missing.into_iter().collect::<Vec<_>>(),
            self.cfg.shard
        ))
    }

    /// Takes gradients for `step` from `worker`; returns the shard's step afterwards.
    pub async fn push(
        self: &Arc<Self>,
        step: u64,
        worker: u32,
        grads: Vec<Grad>,
    ) -> Result<u64, Status> {
        self.check_worker(worker)?;
        self.wait_for(step).await?;
        let me = self.clone();
        let now = blocking(move || me.push_blocking(step, worker, grads)).await?;
        Ok(now)
    }

    fn push_blocking(&self, step: u64, worker: u32, mut grads: Vec<Grad>) -> Result<u64, Status> {
        if grads.is_empty() {
            return Err(Status::invalid_argument(
                "a push without gradients: send at least one tensor",
            ));
        }
        // Locks are taken in name order, so two pushes never wait on each other in a cycle.
        grads.sort_by(|a, b| a.name().cmp(b.name()));
        if let Some(w) = grads.windows(2).find(|w| w[0].name() == w[1].name()) {
            return Err(Status::invalid_argument(format!(
                "variable {:?} appears twice in one push",
                w[0].name()
            )));
        }
        let (epoch, now) = {
            let mut s = self.steps()?;
            // A worker left out of the steps is back in with any push, even a stale one:
            // the next step waits for it again.
            if s.lost.remove(&worker) {
                eprintln!(
                    "ibex-ps shard {}: worker {worker} is back; sync steps wait for it again",
                    self.cfg.shard
                );
            }
            (s.epoch, s.step)
        };
        let cells = {
            let table = self.table()?;
            grads
                .iter()
                .map(|g| {
                    table
                        .get(g.name())
                        .cloned()
                        .ok_or_else(|| unknown(g.name(), self.cfg.shard))
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        for (g, c) in grads.iter().zip(&cells) {
            check_grad(g, c)?;
        }
        let sync = self.cfg.mode == Mode::Sync;
        if sync && step > now {
            return Err(Status::failed_precondition(format!(
                "step {step} is ahead of shard {} (at step {now}): it was restored from a checkpoint; call recover() and resume from its step",
                self.cfg.shard
            )));
        }
        let mut guards = cells
            .iter()
            .map(|c| c.lock())
            .collect::<Result<Vec<_>, _>>()?;
        if sync {
            for (g, st) in grads.iter().zip(&guards) {
                if st.applied > step {
                    return Err(Status::failed_precondition(format!(
                        "stale step: step {step} was already applied on shard {} (now at step {}); pull fresh values and push step {}",
                        self.cfg.shard,
                        self.step(),
                        st.applied
                    )));
                }
                if st.pending.workers.contains(&worker) {
                    return Err(Status::failed_precondition(format!(
                        "worker {worker} already pushed {:?} for step {step}; a step takes one gradient per worker",
                        g.name()
                    )));
                }
            }
        }
        let n = self.cfg.num_workers as usize;
        // Read with the variables locked, so that a step completed without a lost worker
        // (which holds them all) is either wholly before this push or wholly after it.
        let lost = self.steps()?.lost.clone();
        // Each variable whose gradients are all in, with the gradient to apply and its
        // scale (the mean over the workers that pushed it).
        let mut ready: Vec<(&mut VarState, Ready, f32)> = Vec::new();
        for (g, st) in grads.into_iter().zip(guards.iter_mut()) {
            let st: &mut VarState = st;
            if !sync {
                let r = match g {
                    Grad::Dense { values, .. } => Ready::Dense(values),
                    Grad::Sparse { ids, values, .. } => {
                        let mut rows = BTreeMap::new();
                        add_rows(&mut rows, &ids, &values);
                        Ready::Rows(rows)
                    }
                };
                ready.push((st, r, 1.0));
                continue;
            }
            let p = &mut st.pending;
            p.workers.insert(worker);
            match g {
                Grad::Dense { values, .. } => match &mut p.sum {
                    Some(sum) => values.add_to(sum),
                    None => {
                        p.sum = Some(values.into_buf(&self.bufs).map_err(|e| {
                            Status::resource_exhausted(format!("gradient buffer: {e}"))
                        })?)
                    }
                },
                Grad::Sparse { ids, values, .. } => add_rows(&mut p.rows, &ids, &values),
            }
            let all_in = (0..n as u32).all(|w| p.workers.contains(&w) || lost.contains(&w));
            if all_in {
                let p = std::mem::take(&mut st.pending);
                let scale = 1.0 / p.workers.len() as f32;
                let r = match p.sum {
                    Some(sum) => Ready::Dense(F32s::Buf(sum)),
                    None => Ready::Rows(p.rows),
                };
                ready.push((st, r, scale));
            }
        }
        let applied = ready.len();
        ready
            .into_par_iter()
            .try_for_each(|(st, r, scale)| r.apply(st, scale, &self.bufs))?;
        let completed = {
            let mut s = self.steps()?;
            if s.epoch != epoch {
                return Err(Status::aborted(format!(
                    "shard {} was restored from a checkpoint while this push ran: call recover() and resume from its step",
                    self.cfg.shard
                )));
            }
            if sync {
                s.done += applied;
                let all = self.table()?.len();
                if applied > 0 && s.done >= all {
                    s.done = 0;
                    s.step += 1;
                    Some(s.step)
                } else {
                    None
                }
            } else {
                s.step += 1;
                Some(s.step)
            }
        };
        drop(guards);
        let Some(now) = completed else {
            return Ok(self.step());
        };
        if self.cfg.checkpoint_every > 0
            && now % self.cfg.checkpoint_every == 0
            && self.cfg.checkpoint_dir.is_some()
        {
            // Written before anyone can see the step, so a checkpoint never misses a step a
            // worker has already observed as applied.
            self.save_blocking()?;
        }
        self.step_tx.send_replace(now);
        Ok(now)
    }

    /// Current values of `names` and the step they reflect.
    pub async fn read(self: &Arc<Self>, names: Vec<String>) -> Result<(u64, Vec<Values>), Status> {
        self.read_to(names, |_| None).await
    }

    /// As [`Shard::read`], with each snapshot copied into memory from `alloc` (a
    /// connection's registered memory, offered for snapshots that will be answered by
    /// descriptor) while it gives some, so that exposing it for a one-sided pull costs no
    /// registration: registered memory comes back
    /// step after step, where a heap buffer would be registered afresh (verbs) whenever its
    /// address changed. Snapshots it has no room for come from the shard's own buffers.
    /// `alloc` runs on the blocking thread, since it may register memory.
    pub async fn read_to(
        self: &Arc<Self>,
        names: Vec<String>,
        alloc: impl Fn(usize) -> Option<PoolBufMut> + Send + 'static,
    ) -> Result<(u64, Vec<Values>), Status> {
        let me = self.clone();
        blocking(move || me.read_blocking(names, &alloc)).await
    }

    fn read_blocking(
        &self,
        names: Vec<String>,
        alloc: &dyn Fn(usize) -> Option<PoolBufMut>,
    ) -> Result<(u64, Vec<Values>), Status> {
        let step = self.step();
        let cells = {
            let table = self.table()?;
            names
                .iter()
                .map(|n| {
                    table
                        .get(n)
                        .cloned()
                        .ok_or_else(|| unknown(n, self.cfg.shard))
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        let vals = names
            .into_iter()
            .zip(cells)
            .map(|(n, c)| {
                if let Some(b) = c.lock()?.snap.clone() {
                    return Ok((n, c.shape.clone(), b));
                }
                // Memory is found before the lock: `alloc` may register.
                let bytes = c.numel.saturating_mul(4);
                let pooled = alloc(bytes);
                let dest = match pooled {
                    Some(p) => Ok(p),
                    None => Err(self
                        .bufs
                        .take(c.numel)
                        .map_err(|e| Status::resource_exhausted(format!("reading {n:?}: {e}")))?),
                };
                let mut st = c.lock()?;
                if let Some(b) = &st.snap {
                    // Another pull made it meanwhile; ours goes back unused.
                    return Ok((n, c.shape.clone(), b.clone()));
                }
                // Registered memory when there was some, else the shard's own buffer.
                let b = match dest {
                    Ok(mut out) => {
                        copy_le(&mut out, &st.var.data);
                        out.freeze()
                    }
                    Err(mut out) => {
                        out.copy_from_slice(&st.var.data);
                        out.into_le_bytes()
                    }
                };
                st.snap = Some(b.clone());
                Ok((n, c.shape.clone(), b))
            })
            .collect::<Result<Vec<_>, Status>>()?;
        Ok((step, vals))
    }

    /// Rows `ids` of table `table`.
    pub async fn lookup(
        self: &Arc<Self>,
        table: String,
        ids: Vec<u64>,
    ) -> Result<(usize, Vec<f32>), Status> {
        let me = self.clone();
        blocking(move || me.lookup_blocking(&table, &ids)).await
    }

    fn lookup_blocking(&self, table: &str, ids: &[u64]) -> Result<(usize, Vec<f32>), Status> {
        let c = self.table_cell(table)?;
        check_ids(table, &c, ids)?;
        let d = c.row_len();
        let mut out = Vec::new();
        out.try_reserve_exact(ids.len().saturating_mul(d))
            .map_err(|e| {
                Status::resource_exhausted(format!("{} rows of {table:?}: {e}", ids.len()))
            })?;
        let st = c.lock()?;
        for &i in ids {
            out.extend_from_slice(&st.var.data[i as usize * d..(i as usize + 1) * d]);
        }
        Ok((d, out))
    }

    /// The entry of sparse table `table`, or the status that says why there is none.
    fn table_cell(&self, table: &str) -> Result<Arc<Cell>, Status> {
        let c = self.table()?.get(table).cloned().ok_or_else(|| {
            Status::not_found(format!(
                "no sparse table {table:?} on shard {}: create it first",
                self.cfg.shard
            ))
        })?;
        if !c.def.sparse {
            return Err(Status::invalid_argument(format!(
                "{table:?} is a dense variable, not a sparse table"
            )));
        }
        Ok(c)
    }

    /// Row length of sparse table `table`.
    pub fn table_dim(&self, table: &str) -> Result<usize, Status> {
        Ok(self.table_cell(table)?.row_len())
    }

    /// Writes a checkpoint of the current state; returns its step and path.
    pub async fn save(self: &Arc<Self>) -> Result<(u64, PathBuf), Status> {
        let me = self.clone();
        blocking(move || me.save_blocking()).await
    }

    /// As [`Shard::save`], on the calling thread (start-up, shutdown, the push that
    /// completes a step).
    pub fn save_blocking(&self) -> Result<(u64, PathBuf), Status> {
        let Some(dir) = &self.cfg.checkpoint_dir else {
            return Err(Status::failed_precondition(
                "this PS has no --checkpoint-dir",
            ));
        };
        let cells: Vec<Arc<Cell>> = self.table()?.values().cloned().collect();
        // Every variable's lock (in name order, as pushes take them), so no update is half
        // in the file; then the step they reflect.
        let guards = cells
            .iter()
            .map(|c| c.lock())
            .collect::<Result<Vec<_>, _>>()?;
        let step = self.steps()?.step;
        let vars: Vec<&Var> = guards.iter().map(|g| &g.var).collect();
        checkpoint::save(dir, self.cfg.shard, step, &vars)
            .map(|p| (step, p))
            .map_err(|e| Status::internal(format!("writing checkpoint: {e}")))
    }

    /// Steps of the checkpoints on disk, oldest first.
    pub fn checkpoints(&self) -> Vec<u64> {
        match &self.cfg.checkpoint_dir {
            Some(dir) => checkpoint::list(dir, self.cfg.shard),
            None => Vec::new(),
        }
    }

    /// Replaces the state with the checkpoint of `step`.
    pub async fn restore(self: &Arc<Self>, step: u64) -> Result<u64, Status> {
        let me = self.clone();
        blocking(move || me.restore_blocking(step)).await
    }

    /// As [`Shard::restore`], on the calling thread (start-up).
    pub fn restore_blocking(&self, step: u64) -> Result<u64, Status> {
        let Some(dir) = &self.cfg.checkpoint_dir else {
            return Err(Status::failed_precondition(
                "this PS has no --checkpoint-dir",
            ));
        };
        if !self.checkpoints().contains(&step) {
            return Err(Status::not_found(format!(
                "shard {} has no checkpoint of step {step} (it has {:?})",
                self.cfg.shard,
                self.checkpoints()
            )));
        }
        let (s, vars) = checkpoint::load(dir, self.cfg.shard, step, &self.cfg.limits)
            .map_err(|e| Status::internal(format!("reading checkpoint: {e}")))?;
        let mut held = Footprint::default();
        for v in vars.values() {
            let f = v.footprint();
            held.elements += f.elements;
            held.bytes += f.bytes;
        }
        {
            let mut steps = self.steps()?;
            let mut table = self.vars.write().map_err(|_| poisoned())?;
            *table = vars
                .into_iter()
                .map(|(name, v)| (name, Cell::new(v, s)))
                .collect();
            steps.step = s;
            steps.done = 0;
            steps.epoch += 1;
            steps.lost.clear();
            steps.held = held;
        }
        self.step_tx.send_replace(s);
        Ok(s)
    }

    /// Variable definitions held.
    pub fn defs(&self) -> Vec<pb::VariableDef> {
        self.table()
            .map(|t| t.values().map(|c| c.def.clone()).collect())
            .unwrap_or_default()
    }

    /// Number of variables held.
    pub fn num_vars(&self) -> usize {
        self.table().map(|t| t.len()).unwrap_or(0)
    }
}

/// A variable's gradient, complete for this step.
enum Ready {
    Dense(F32s),
    Rows(BTreeMap<u64, Vec<f32>>),
}

impl Ready {
    fn apply(self, st: &mut VarState, scale: f32, bufs: &Arc<BufPool>) -> Result<(), Status> {
        // Readers keep the old snapshot; the next read copies the new values.
        st.snap = None;
        match self {
            Ready::Dense(g) => {
                // Unscaled values that can be seen as f32 (a pooled buffer, aligned body
                // bytes) are applied where they lie; scaling needs a writable buffer.
                if scale == 1.0
                    && let Some(v) = g.as_f32()
                {
                    st.var.apply_dense(v);
                } else {
                    let mut b = g
                        .into_buf(bufs)
                        .map_err(|e| Status::resource_exhausted(format!("gradient buffer: {e}")))?;
                    if scale != 1.0 {
                        b.iter_mut().for_each(|x| *x *= scale);
                    }
                    st.var.apply_dense(&b);
                }
            }
            Ready::Rows(mut rows) => {
                if scale != 1.0 {
                    rows.values_mut()
                        .for_each(|r| r.iter_mut().for_each(|x| *x *= scale));
                }
                st.var.apply_rows(&rows);
            }
        }
        st.applied += 1;
        Ok(())
    }
}

/// Checks a gradient against its variable before anything is locked or accumulated.
fn check_grad(g: &Grad, c: &Cell) -> Result<(), Status> {
    match g {
        Grad::Dense { name, values } => {
            if c.def.sparse {
                return Err(Status::invalid_argument(format!(
                    "{name:?} is a sparse table: use PushSparse"
                )));
            }
            if values.len() != c.numel {
                return Err(Status::invalid_argument(format!(
                    "gradient for {name:?} has {} elements, the variable has shape {:?} ({} elements)",
                    values.len(),
                    c.shape,
                    c.numel
                )));
            }
        }
        Grad::Sparse { name, ids, values } => {
            if !c.def.sparse {
                return Err(Status::invalid_argument(format!(
                    "{name:?} is a dense variable, not a sparse table"
                )));
            }
            check_ids(name, c, ids)?;
            if Some(values.len()) != ids.len().checked_mul(c.row_len()) {
                return Err(Status::invalid_argument(format!(
                    "sparse gradient for {name:?} has {} values, expected {} ids x dim {}",
                    values.len(),
                    ids.len(),
                    c.row_len()
                )));
            }
        }
    }
    Ok(())
}

fn unknown(name: &str, shard: u32) -> Status {
    Status::not_found(format!(
        "unknown variable {name:?} on shard {shard}: create it with CreateVariables first"
    ))
}

fn check_ids(name: &str, c: &Cell, ids: &[u64]) -> Result<(), Status> {
    let rows = c.shape[0] as u64;
    if let Some(bad) = ids.iter().find(|&&i| i >= rows) {
        return Err(Status::out_of_range(format!(
            "id {bad} is out of range for table {name:?} with {rows} rows"
        )));
    }
    Ok(())
}

fn add_rows(rows: &mut BTreeMap<u64, Vec<f32>>, ids: &[u64], values: &F32s) {
    if ids.is_empty() {
        return;
    }
    let owned;
    let values: &[f32] = match values.as_f32() {
        Some(v) => v,
        None => {
            owned = match values {
                F32s::Le(b) => ibex_proto::tensor::f32_from_le_bytes(b),
                F32s::Buf(b) => b.to_vec(),
            };
            &owned
        }
    };
    let d = values.len() / ids.len();
    for (k, &id) in ids.iter().enumerate() {
        let g = &values[k * d..(k + 1) * d];
        match rows.get_mut(&id) {
            Some(acc) => acc.iter_mut().zip(g).for_each(|(a, b)| *a += b),
            None => {
                rows.insert(id, g.to_vec());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Worker 0's step-0 push of 2.0 into each of `w`'s four elements.
    async fn push_twos(s: &Arc<Shard>) {
        s.push(
            0,
            0,
            vec![Grad::Dense {
                name: "w".into(),
                values: vec![2.0; 4].into(),
            }],
        )
        .await
        .unwrap();
    }

    fn shard() -> Arc<Shard> {
        shard_with(1, WorkerLoss::Fail, Duration::from_secs(5))
    }

    /// `w`: four f32 of 1.0, plain SGD with lr 0.5.
    fn shard_with(num_workers: u32, loss: WorkerLoss, sync_timeout: Duration) -> Arc<Shard> {
        let s = Shard::new(ShardConfig {
            shard: 0,
            num_workers,
            mode: Mode::Sync,
            sync_timeout,
            checkpoint_dir: None,
            checkpoint_every: 0,
            limits: Limits::default(),
            on_worker_loss: loss,
        });
        s.create(vec![pb::VariableDef {
            name: "w".into(),
            dtype: pb::Dtype::F32 as i32,
            shape: vec![4],
            init: Some(pb::Initializer {
                kind: Some(pb::initializer::Kind::Constant(1.0)),
            }),
            optimizer: Some(pb::Optimizer {
                kind: Some(pb::optimizer::Kind::Sgd(pb::Sgd { lr: 0.5 })),
            }),
            ..Default::default()
        }])
        .unwrap();
        Arc::new(s)
    }

    /// A read that waits for a variable's lock (held here as an optimizer update would
    /// hold it) must leave the runtime's only thread free for other tasks. Were the wait
    /// on that thread, the test would deadlock: a watchdog turns that into a failure.
    fn grad(v: f32) -> Vec<Grad> {
        vec![Grad::Dense {
            name: "w".into(),
            values: vec![v; 4].into(),
        }]
    }

    async fn value(s: &Arc<Shard>) -> f32 {
        let (_, vals) = s.read(vec!["w".into()]).await.unwrap();
        f32::from_le_bytes(vals[0].2[..4].try_into().unwrap())
    }

    /// `continue`: a step a worker misses completes at the sync timeout with the others'
    /// mean, later steps go on without it, and its next push (even a stale one) takes it
    /// back in, after which steps average over both again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_worker_is_left_out_until_it_pushes_again() {
        let s = shard_with(2, WorkerLoss::Continue, Duration::from_millis(200));
        s.push(0, 0, grad(2.0)).await.unwrap();
        let t0 = std::time::Instant::now();
        s.wait_for(1).await.unwrap();
        assert!(
            t0.elapsed() >= Duration::from_millis(150),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!((s.step(), value(&s).await), (1, 0.0));
        // Worker 1 is out: worker 0 alone completes step 1 at once.
        s.push(1, 0, grad(2.0)).await.unwrap();
        assert_eq!((s.step(), value(&s).await), (2, -1.0));
        // Back with a stale push: refused, but step 2 waits for it.
        let e = s.push(1, 1, grad(9.0)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        s.push(2, 0, grad(2.0)).await.unwrap();
        assert_eq!(s.step(), 2, "step 2 must wait for the returned worker");
        s.push(2, 1, grad(4.0)).await.unwrap();
        assert_eq!((s.step(), value(&s).await), (3, -2.5));
        // Nobody pushed: nothing to complete, the wait fails as in `fail` mode.
        let e = s.wait_for(4).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    }

    /// `fail` (the default): the missed step fails, naming the worker, and nothing applies.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_missed_step_fails_by_default_naming_the_worker() {
        let s = shard_with(2, WorkerLoss::Fail, Duration::from_millis(200));
        s.push(0, 0, grad(2.0)).await.unwrap();
        let e = s.wait_for(1).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded);
        assert!(e.message().contains("workers [1]"), "{}", e.message());
        assert_eq!((s.step(), value(&s).await), (0, 1.0));
    }

    #[tokio::test(flavor = "current_thread")]
    // Holding the variable's lock across awaits is the point: it stands for an update.
    #[allow(clippy::await_holding_lock)]
    async fn a_read_waiting_on_a_variable_leaves_the_runtime_free() {
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watch = done.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(30));
            if !watch.load(std::sync::atomic::Ordering::Relaxed) {
                eprintln!("a read blocked the runtime thread on a variable's lock");
                std::process::abort();
            }
        });
        let s = shard();
        let cell = s.cell("w").unwrap();
        let held = cell.lock().unwrap();
        let read = tokio::spawn({
            let s = s.clone();
            async move { s.read(vec!["w".into()]).await }
        });
        tokio::task::yield_now().await;
        assert_eq!(tokio::spawn(async { 7 }).await.unwrap(), 7);
        assert!(!read.is_finished(), "the read waits for the lock");
        drop(held);
        let (step, vals) = read.await.unwrap().unwrap();
        assert_eq!(step, 0);
        assert_eq!(&vals[0].2[..], &[1.0f32.to_le_bytes(); 4].concat()[..]);
        // A push applies and the read sees it, through the same locks.
        push_twos(&s).await;
        let (step, vals) = s.read(vec!["w".into()]).await.unwrap();
        assert_eq!(step, 1);
        assert_eq!(&vals[0].2[..], &[0.0f32.to_le_bytes(); 4].concat()[..]);
        done.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Pulls of one version share one snapshot (one copy, not one per worker); an update
    /// makes the next read copy afresh, while the old snapshot keeps the old values.
    #[tokio::test]
    async fn reads_of_one_version_share_a_snapshot_until_the_next_update() {
        let s = shard();
        let (_, a) = s.read(vec!["w".into()]).await.unwrap();
        let (_, b) = s.read(vec!["w".into()]).await.unwrap();
        assert_eq!(
            a[0].2.as_ptr(),
            b[0].2.as_ptr(),
            "the second read copied again"
        );
        push_twos(&s).await;
        let (_, c) = s.read(vec!["w".into()]).await.unwrap();
        assert_eq!(&c[0].2[..], &[0.0f32.to_le_bytes(); 4].concat()[..]);
        assert_eq!(&a[0].2[..], &[1.0f32.to_le_bytes(); 4].concat()[..]);
    }
}
