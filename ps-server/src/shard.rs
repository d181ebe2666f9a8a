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
//! All state sits behind one mutex; a push takes it on a blocking section (`block_in_place`)
//! and the optimizer math of a step runs in parallel across variables (rayon), each
//! variable on one thread.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use ibex_proto::ps::v1 as pb;
use rayon::prelude::*;
use tokio::sync::watch;
use tonic::Status;

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

impl Var {
    pub fn new(def: pb::VariableDef) -> Result<Var, Status> {
        let bad = |m: String| Status::invalid_argument(format!("variable {:?}: {m}", def.name));
        if def.name.is_empty() {
            return Err(Status::invalid_argument(
                "a variable needs a non-empty name",
            ));
        }
        dtype(def.dtype).map_err(bad)?;
        let optim = Optimizer::from_pb(def.optimizer.as_ref()).map_err(bad)?;
        let shape: Vec<usize> = def.shape.iter().map(|&d| d as usize).collect();
        if def.sparse && shape.len() != 2 {
            return Err(bad(format!(
                "a sparse table must be 2-D [rows, dim], got shape {shape:?}"
            )));
        }
        let too_large = || {
            bad(format!(
                "shape {shape:?} is too large for one shard; partition it"
            ))
        };
        let numel = numel(&def.shape)
            .filter(|&n| n <= MAX_ELEMENTS)
            .ok_or_else(too_large)? as usize;
        let full = if def.full_shape.is_empty() {
            def.shape.clone()
        } else {
            def.full_shape.clone()
        };
        let row_len =
            numel_of_rows(&full).ok_or_else(|| bad(format!("full shape {full:?} overflows")))?;
        if full.first().is_some_and(|&r| {
            def.row_offset
                .saturating_add(def.shape.first().copied().unwrap_or(1))
                > r
        }) {
            return Err(bad(format!(
                "rows {}..+{:?} lie outside the full shape {full:?}",
                def.row_offset,
                def.shape.first()
            )));
        }
        let mut data =
            init::values(def.init.as_ref(), &full, def.row_offset * row_len, numel).map_err(bad)?;
        round_to(def.dtype, &mut data);
        let slots = vec![vec![0.0; numel]; optim.num_slots()];
        let t = vec![0; if def.sparse { shape[0] } else { 1 }];
        Ok(Var {
            def,
            optim,
            shape,
            data,
            slots,
            t,
        })
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

/// Elements one variable may hold on a shard (16 GiB of f32); larger ones must be partitioned.
const MAX_ELEMENTS: u64 = 1 << 32;

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

/// A decoded gradient for one variable (checked against the variable by [`Shard::push`]).
#[derive(Debug, Clone)]
pub enum Grad {
    /// A whole dense gradient.
    Dense {
        /// Variable name on this shard.
        name: String,
        /// One value per element.
        values: Vec<f32>,
    },
    /// Row gradients of a sparse table.
    Sparse {
        /// Table name on this shard.
        name: String,
        /// Row ids (duplicates are summed).
        ids: Vec<u64>,
        /// `ids.len() * dim` values.
        values: Vec<f32>,
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
    sum: Vec<f32>,
    rows: BTreeMap<u64, Vec<f32>>,
    workers: BTreeSet<u32>,
}

pub(crate) struct Inner {
    pub step: u64,
    pub vars: BTreeMap<String, Var>,
    pending: BTreeMap<String, Pending>,
}

/// One variable's name, shape and f32 values, as read.
pub type Values = (String, Vec<usize>, Vec<f32>);

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
}

/// The shard's state and its step notifications.
pub struct Shard {
    pub(crate) cfg: ShardConfig,
    inner: Mutex<Inner>,
    step_tx: watch::Sender<u64>,
}

fn poisoned() -> Status {
    Status::internal(
        "the shard's state lock is poisoned by an earlier panic; restart the PS with --restore",
    )
}

impl Shard {
    /// An empty shard at step 0.
    pub fn new(cfg: ShardConfig) -> Shard {
        let (step_tx, _) = watch::channel(0);
        Shard {
            cfg,
            inner: Mutex::new(Inner {
                step: 0,
                vars: BTreeMap::new(),
                pending: BTreeMap::new(),
            }),
            step_tx,
        }
    }

    pub(crate) fn with<T>(
        &self,
        f: impl FnOnce(&mut Inner) -> Result<T, Status>,
    ) -> Result<T, Status> {
        let mut g = self.inner.lock().map_err(|_| poisoned())?;
        f(&mut g)
    }

    /// Steps applied so far.
    pub fn step(&self) -> u64 {
        *self.step_tx.borrow()
    }

    /// Creates variables; returns how many were new.
    pub fn create(&self, defs: Vec<pb::VariableDef>) -> Result<u32, Status> {
        let vars = defs
            .into_iter()
            .map(Var::new)
            .collect::<Result<Vec<_>, _>>()?;
        self.with(|st| {
            for v in &vars {
                if let Some(old) = st.vars.get(&v.def.name)
                    && old.def != v.def
                {
                    return Err(Status::already_exists(format!(
                        "variable {:?} exists with a different definition (dtype, shape, initializer or optimizer)",
                        v.def.name
                    )));
                }
            }
            let mut created = 0;
            for v in vars {
                if !st.vars.contains_key(&v.def.name) {
                    st.vars.insert(v.def.name.clone(), v);
                    created += 1;
                }
            }
            Ok(created)
        })
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
    pub async fn wait_for(&self, step: u64) -> Result<(), Status> {
        if self.cfg.mode == Mode::Async {
            return Ok(());
        }
        let mut rx = self.step_tx.subscribe();
        match tokio::time::timeout(self.cfg.sync_timeout, rx.wait_for(|s| *s >= step)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(Status::unavailable("the PS is shutting down")),
            Err(_) => Err(self.timeout_status(step)),
        }
    }

    fn timeout_status(&self, wanted: u64) -> Status {
        let detail = self
            .with(|st| {
                let mut missing = BTreeSet::new();
                for name in st.vars.keys() {
                    let pushed = st.pending.get(name).map(|p| &p.workers);
                    for w in 0..self.cfg.num_workers {
                        if !pushed.is_some_and(|p| p.contains(&w)) {
                            missing.insert(w);
                        }
                    }
                }
                Ok(format!(
                    "step {} has not been applied after {:?}: workers {:?} have not pushed all variables of shard {} for it",
                    st.step, self.cfg.sync_timeout, missing.into_iter().collect::<Vec<_>>(), self.cfg.shard
                ))
            })
            .unwrap_or_else(|e| e.message().to_string());
        Status::deadline_exceeded(format!("waiting for step {wanted}: {detail}"))
    }

    /// Takes gradients for `step` from `worker`; returns the shard's step afterwards.
    pub async fn push(&self, step: u64, worker: u32, grads: Vec<Grad>) -> Result<u64, Status> {
        self.check_worker(worker)?;
        self.wait_for(step).await?;
        blocking(|| self.push_locked(step, worker, grads))
    }

    fn push_locked(&self, step: u64, worker: u32, grads: Vec<Grad>) -> Result<u64, Status> {
        let r = self.with(|st| {
            self.validate(st, step, worker, &grads)?;
            match self.cfg.mode {
                Mode::Async => {
                    let mut one = BTreeMap::new();
                    for g in grads {
                        one.insert(g.name().to_string(), to_pending(g, st));
                    }
                    apply(st, one, 1.0);
                    st.step += 1;
                }
                Mode::Sync => {
                    for g in grads {
                        let name = g.name().to_string();
                        let p = st.pending.entry(name).or_default();
                        p.workers.insert(worker);
                        match g {
                            Grad::Dense { values, .. } => {
                                if p.sum.is_empty() {
                                    p.sum = values;
                                } else {
                                    p.sum.iter_mut().zip(&values).for_each(|(s, v)| *s += v);
                                }
                            }
                            Grad::Sparse { ids, values, .. } => {
                                add_rows(&mut p.rows, &ids, &values)
                            }
                        }
                    }
                    let n = self.cfg.num_workers as usize;
                    let complete = st
                        .vars
                        .keys()
                        .all(|k| st.pending.get(k).is_some_and(|p| p.workers.len() == n));
                    if !complete {
                        return Ok(None);
                    }
                    let pending = std::mem::take(&mut st.pending);
                    apply(st, pending, 1.0 / n as f32);
                    st.step += 1;
                }
            }
            Ok(Some(st.step))
        })?;
        let Some(now) = r else { return Ok(self.step()) };
        if self.cfg.checkpoint_every > 0
            && now % self.cfg.checkpoint_every == 0
            && self.cfg.checkpoint_dir.is_some()
        {
            // Written before anyone can see the step, so a checkpoint never misses a step a
            // worker has already observed as applied.
            self.save()?;
        }
        self.step_tx.send_replace(now);
        Ok(now)
    }

    fn validate(&self, st: &Inner, step: u64, worker: u32, grads: &[Grad]) -> Result<(), Status> {
        if self.cfg.mode == Mode::Sync && step < st.step {
            return Err(Status::failed_precondition(format!(
                "stale step: step {step} was already applied on shard {} (now at step {}); pull fresh values and push step {}",
                self.cfg.shard, st.step, st.step
            )));
        }
        if self.cfg.mode == Mode::Sync && step > st.step {
            return Err(Status::failed_precondition(format!(
                "step {step} is ahead of shard {} (at step {}): it was restored from a checkpoint; call recover() and resume from its step",
                self.cfg.shard, st.step
            )));
        }
        if grads.is_empty() {
            return Err(Status::invalid_argument(
                "a push without gradients: send at least one tensor",
            ));
        }
        let mut seen = BTreeSet::new();
        for g in grads {
            let name = g.name();
            if !seen.insert(name) {
                return Err(Status::invalid_argument(format!(
                    "variable {name:?} appears twice in one push"
                )));
            }
            let v = st
                .vars
                .get(name)
                .ok_or_else(|| unknown(name, self.cfg.shard))?;
            match g {
                Grad::Dense { values, .. } => {
                    if v.def.sparse {
                        return Err(Status::invalid_argument(format!(
                            "{name:?} is a sparse table: use PushSparse"
                        )));
                    }
                    if values.len() != v.data.len() {
                        return Err(Status::invalid_argument(format!(
                            "gradient for {name:?} has {} elements, the variable has shape {:?} ({} elements)",
                            values.len(),
                            v.shape,
                            v.data.len()
                        )));
                    }
                }
                Grad::Sparse { ids, values, .. } => {
                    if !v.def.sparse {
                        return Err(Status::invalid_argument(format!(
                            "{name:?} is a dense variable, not a sparse table"
                        )));
                    }
                    check_ids(name, v, ids)?;
                    if values.len() != ids.len() * v.row_len() {
                        return Err(Status::invalid_argument(format!(
                            "sparse gradient for {name:?} has {} values, expected {} ids x dim {}",
                            values.len(),
                            ids.len(),
                            v.row_len()
                        )));
                    }
                }
            }
            if self.cfg.mode == Mode::Sync
                && st
                    .pending
                    .get(name)
                    .is_some_and(|p| p.workers.contains(&worker))
            {
                return Err(Status::failed_precondition(format!(
                    "worker {worker} already pushed {name:?} for step {step}; a step takes one gradient per worker"
                )));
            }
        }
        Ok(())
    }

    /// Current values of `names` and the step they reflect.
    pub fn read(&self, names: &[String]) -> Result<(u64, Vec<Values>), Status> {
        self.with(|st| {
            let vals = names
                .iter()
                .map(|n| {
                    let v = st.vars.get(n).ok_or_else(|| unknown(n, self.cfg.shard))?;
                    Ok((n.clone(), v.shape.clone(), v.data.clone()))
                })
                .collect::<Result<Vec<_>, Status>>()?;
            Ok((st.step, vals))
        })
    }

    /// Rows `ids` of table `table`.
    pub fn lookup(&self, table: &str, ids: &[u64]) -> Result<(usize, Vec<f32>), Status> {
        self.with(|st| {
            let v = st.vars.get(table).ok_or_else(|| {
                Status::not_found(format!(
                    "no sparse table {table:?} on shard {}: create it first",
                    self.cfg.shard
                ))
            })?;
            if !v.def.sparse {
                return Err(Status::invalid_argument(format!(
                    "{table:?} is a dense variable, not a sparse table"
                )));
            }
            check_ids(table, v, ids)?;
            let d = v.row_len();
            let mut out = Vec::with_capacity(ids.len() * d);
            for &i in ids {
                out.extend_from_slice(&v.data[i as usize * d..(i as usize + 1) * d]);
            }
            Ok((d, out))
        })
    }

    /// Writes a checkpoint of the current state; returns its step and path.
    pub fn save(&self) -> Result<(u64, PathBuf), Status> {
        let Some(dir) = &self.cfg.checkpoint_dir else {
            return Err(Status::failed_precondition(
                "this PS has no --checkpoint-dir",
            ));
        };
        self.with(|st| {
            checkpoint::save(dir, self.cfg.shard, st.step, &st.vars)
                .map(|p| (st.step, p))
                .map_err(|e| Status::internal(format!("writing checkpoint: {e}")))
        })
    }

    /// Steps of the checkpoints on disk, oldest first.
    pub fn checkpoints(&self) -> Vec<u64> {
        match &self.cfg.checkpoint_dir {
            Some(dir) => checkpoint::list(dir, self.cfg.shard),
            None => Vec::new(),
        }
    }

    /// Replaces the state with the checkpoint of `step`.
    pub fn restore(&self, step: u64) -> Result<u64, Status> {
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
        let (s, vars) = checkpoint::load(dir, self.cfg.shard, step)
            .map_err(|e| Status::internal(format!("reading checkpoint: {e}")))?;
        self.with(|st| {
            st.step = s;
            st.vars = vars;
            st.pending.clear();
            Ok(())
        })?;
        self.step_tx.send_replace(s);
        Ok(s)
    }

    /// Variable definitions held.
    pub fn defs(&self) -> Vec<pb::VariableDef> {
        self.with(|st| Ok(st.vars.values().map(|v| v.def.clone()).collect()))
            .unwrap_or_default()
    }
}

/// Runs the optimizer math and checkpoint I/O of a push without stalling the other tasks of
/// a multi-threaded runtime (a current-thread runtime, as in some tests, just runs it).
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

fn unknown(name: &str, shard: u32) -> Status {
    Status::not_found(format!(
        "unknown variable {name:?} on shard {shard}: create it with CreateVariables first"
    ))
}

fn check_ids(name: &str, v: &Var, ids: &[u64]) -> Result<(), Status> {
    let rows = v.shape[0] as u64;
    if let Some(bad) = ids.iter().find(|&&i| i >= rows) {
        return Err(Status::out_of_range(format!(
            "id {bad} is out of range for table {name:?} with {rows} rows"
        )));
    }
    Ok(())
}

fn add_rows(rows: &mut BTreeMap<u64, Vec<f32>>, ids: &[u64], values: &[f32]) {
    if ids.is_empty() {
        return;
    }
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

fn to_pending(g: Grad, _st: &Inner) -> Pending {
    let mut p = Pending::default();
    match g {
        Grad::Dense { values, .. } => p.sum = values,
        Grad::Sparse { ids, values, .. } => add_rows(&mut p.rows, &ids, &values),
    }
    p
}

/// Applies `scale * gradient` to each variable in `pending`, variables in parallel.
fn apply(st: &mut Inner, mut pending: BTreeMap<String, Pending>, scale: f32) {
    let mut work: Vec<(&mut Var, Pending)> = st
        .vars
        .iter_mut()
        .filter_map(|(k, v)| pending.remove(k).map(|p| (v, p)))
        .collect();
    work.par_iter_mut().for_each(|(v, p)| {
        if scale != 1.0 {
            p.sum.iter_mut().for_each(|x| *x *= scale);
            p.rows
                .values_mut()
                .for_each(|r| r.iter_mut().for_each(|x| *x *= scale));
        }
        if v.def.sparse {
            v.apply_rows(&p.rows);
        } else {
            v.apply_dense(&p.sum);
        }
    });
}
