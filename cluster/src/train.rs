//! The training job: the distributed worker loop (PS-held variables, sync steps, recovery
//! after a PS restart) and the single-process reference that does the same math locally.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ibex_worker::{ClusterSpec, Dtype, Init, Optimizer, VarSpec, Worker, WorkerError};
use serde::{Deserialize, Serialize};

use crate::data::{self, Dataset, Schedule};
use crate::gpu::{Device, Trainer};
use crate::model::{LocalMomentum, Mlp, Params};

/// Hyper-parameters and data of a training run; the same flags drive `ibex demo`,
/// `ibex launch --job worker` and `ibex train --reference`, so every process agrees.
#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// Sync steps; each applies one gradient averaged over all workers.
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    /// Global minibatch per step, split evenly across workers.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.05)]
    pub lr: f32,
    /// Momentum (0 = plain SGD).
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f32,
    /// Hidden units of the MLP.
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    /// Seed of the train/test split, the data order and the initial weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Examples held out for the test accuracy.
    #[arg(long, default_value_t = 300)]
    pub test_size: usize,
    /// Train on MNIST IDX files in this directory instead of the embedded digits.
    #[arg(long)]
    pub mnist: Option<PathBuf>,
    /// Print the loss every this many steps.
    #[arg(long, default_value_t = 25)]
    pub log_every: u64,
    /// Push the output layer's gradients while the hidden layer's are computed, then pull
    /// (`Worker::begin_step`), instead of one PushPull per PS after the backward pass. Off
    /// by default: with this small model on a few cores the extra RPCs cost more than the
    /// overlap saves (see docs/demo.md).
    #[arg(long)]
    pub overlap: bool,
    /// Where workers compute: `cpu`, or `cuda` (a build with `--features cuda` and a GPU).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// When a PS is lost mid-training, wait this long for it to come back (restarted with
    /// `--restore`) and resume from the PS's common checkpoint; past it, or at 0, fail with
    /// an error naming the PS.
    #[arg(long, default_value_t = 60.0)]
    pub ps_restart_wait_secs: f64,
}

impl TrainArgs {
    /// The flags that reproduce these arguments in a child process.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            format!("--steps={}", self.steps),
            format!("--batch={}", self.batch),
            format!("--lr={}", self.lr),
            format!("--momentum={}", self.momentum),
            format!("--hidden={}", self.hidden),
            format!("--seed={}", self.seed),
            format!("--test-size={}", self.test_size),
            format!("--log-every={}", self.log_every),
            format!("--device={}", self.device.as_str()),
            format!("--ps-restart-wait-secs={}", self.ps_restart_wait_secs),
        ];
        if self.overlap {
            v.push("--overlap".into());
        }
        if let Some(m) = &self.mnist {
            v.push(format!("--mnist={}", m.display()));
        }
        v
    }
}

/// What a run produced; worker 0 and the reference write it as JSON (`--report`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Workers that shared each step (1 for the reference).
    pub workers: usize,
    /// Steps applied when the run ended.
    pub steps: u64,
    /// `(step, loss)` every `--log-every` steps: this worker's share of the minibatch.
    pub losses: Vec<(u64, f32)>,
    /// Mean loss over the whole training set with the final weights.
    pub train_loss: f32,
    /// Test-set accuracy with the final weights.
    pub test_accuracy: f32,
    /// Training steps per second (the steps this process ran, after connecting).
    pub steps_per_sec: f64,
    /// How many times the worker reconnected and resumed after a PS failure.
    pub recoveries: u32,
    /// Weights before step 0, when this process started there (kept across recoveries:
    /// a restore never goes back past step 0).
    pub initial: Option<Params>,
    /// Final weights, in [`Mlp::NAMES`] order.
    pub params: Params,
    /// The worker's communication profile (empty for the reference).
    pub comm_profile: String,
}

impl Report {
    /// Checks that `other` holds tensors of the same sizes.
    pub fn mlp_check_same_shape(&self, other: &Report) -> Result<(), String> {
        let sizes = |r: &Report| r.params.iter().map(Vec::len).collect::<Vec<_>>();
        if sizes(self) != sizes(other) {
            return Err(format!(
                "the reports hold different models: {:?} vs {:?}",
                sizes(self),
                sizes(other)
            ));
        }
        Ok(())
    }

    /// Reads a report written with `--report`.
    pub fn read(path: &Path) -> Result<Report, String> {
        let s = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read report {}: {e}", path.display()))?;
        serde_json::from_str(&s).map_err(|e| format!("report {} is not valid: {e}", path.display()))
    }

    /// Writes the report as JSON.
    pub fn write(&self, path: &Path) -> Result<(), String> {
        let s =
            serde_json::to_string(self).map_err(|e| format!("cannot encode the report: {e}"))?;
        std::fs::write(path, s).map_err(|e| format!("cannot write report {}: {e}", path.display()))
    }
}

/// The model, the split data and the step schedule for `args`.
pub struct Job {
    /// Layer sizes.
    pub mlp: Mlp,
    /// Training examples.
    pub train: Dataset,
    /// Held-out examples.
    pub test: Dataset,
    /// Which examples each step uses.
    pub schedule: Schedule,
}

impl Job {
    /// Loads the data and checks that `workers` can share the minibatch evenly (the sync
    /// average equals the full-batch gradient only when the shares are equal).
    pub fn new(args: &TrainArgs, workers: usize) -> Result<Job, String> {
        if workers == 0 || args.batch == 0 || !args.batch.is_multiple_of(workers) {
            return Err(format!(
                "--batch {} must be a positive multiple of the {workers} workers",
                args.batch
            ));
        }
        if args.steps == 0 || args.hidden == 0 || args.log_every == 0 {
            return Err("--steps, --hidden and --log-every must be positive".into());
        }
        let all = match &args.mnist {
            Some(dir) => data::mnist(dir)?,
            None => data::digits()?,
        };
        let (train, test) = all.split(args.seed, args.test_size)?;
        let mlp = Mlp {
            input: all.dim,
            hidden: args.hidden,
            classes: all.classes,
        };
        let schedule = Schedule::new(train.len(), args.batch, args.seed);
        Ok(Job {
            mlp,
            train,
            test,
            schedule,
        })
    }

    /// The PS variables: one per tensor, f32, momentum (or SGD) applied server-side.
    pub fn var_specs(&self, args: &TrainArgs) -> Vec<VarSpec> {
        let optimizer = if args.momentum == 0.0 {
            Optimizer::Sgd { lr: args.lr }
        } else {
            Optimizer::Momentum {
                lr: args.lr,
                momentum: args.momentum,
            }
        };
        Mlp::NAMES
            .iter()
            .zip(self.mlp.shapes())
            .enumerate()
            .map(|(i, (name, shape))| VarSpec {
                name: (*name).to_string(),
                dtype: Dtype::F32,
                init: if shape.len() == 2 {
                    Init::GlorotUniform {
                        seed: args.seed.wrapping_add(i as u64),
                    }
                } else {
                    Init::Zeros
                },
                shape,
                optimizer,
                sparse: false,
            })
            .collect()
    }

    fn finish(
        &self,
        workers: usize,
        steps: u64,
        losses: Vec<(u64, f32)>,
        params: Params,
    ) -> Report {
        let (train_loss, _) = self.mlp.evaluate(&params, &self.train);
        let (_, test_accuracy) = self.mlp.evaluate(&params, &self.test);
        Report {
            workers,
            steps,
            losses,
            train_loss,
            test_accuracy,
            steps_per_sec: 0.0,
            recoveries: 0,
            initial: None,
            params,
            comm_profile: String::new(),
        }
    }
}

/// Prints the progress line `ibex demo` follows (`step K loss L`).
fn log_step(args: &TrainArgs, step: u64, loss: f32, losses: &mut Vec<(u64, f32)>) {
    if step.is_multiple_of(args.log_every) || step + 1 == args.steps {
        losses.push((step, loss));
        println!("step {step} loss {loss:.5}");
    }
}

/// One process, no PS: the full minibatch each step, the same update rule the PS applies.
/// `initial` makes it start from the weights a distributed run began with (its PS chose them).
pub fn run_reference(args: &TrainArgs, initial: Option<Params>) -> Result<Report, String> {
    let job = Job::new(args, 1)?;
    let mut params = match initial {
        Some(p) => {
            job.mlp.check(&p)?;
            p
        }
        None => job.mlp.init(args.seed),
    };
    let start_params = params.clone();
    let mut opt = LocalMomentum::new(args.lr, args.momentum, &params);
    let mut losses = Vec::new();
    let t0 = Instant::now();
    for step in 0..args.steps {
        let batch = job.train.gather(&job.schedule.shard(step, 0, 1));
        let (loss, grads) = job.mlp.loss_and_grad(&params, &batch);
        opt.apply(&mut params, &grads);
        log_step(args, step, loss, &mut losses);
    }
    let secs = t0.elapsed().as_secs_f64();
    let mut r = job.finish(1, args.steps, losses, params);
    r.steps_per_sec = args.steps as f64 / secs.max(1e-9);
    r.initial = Some(start_params);
    Ok(r)
}

/// Errors after which the job can continue once the PS are back: a lost connection, a PS
/// that stopped answering, a sync step that timed out while a PS failed (see
/// [`lost_worker`]), or a step the PS no longer expects because it was restored. Bad
/// requests are not retried.
fn recoverable(e: &WorkerError) -> bool {
    match e {
        WorkerError::Unavailable { .. }
        | WorkerError::Timeout { .. }
        | WorkerError::Deadline { .. }
        | WorkerError::StaleStep { .. }
        | WorkerError::Transport(_) => true,
        WorkerError::Rpc { code, .. } => matches!(
            code,
            tonic::Code::Unavailable
                | tonic::Code::Aborted
                | tonic::Code::Cancelled
                | tonic::Code::Unknown
        ),
        _ => false,
    }
}

/// Gives up after this many recoveries in one run, so a PS that keeps failing ends the job
/// with its error instead of looping.
const MAX_RECOVERIES: u32 = 10;

/// Whether a sync step that timed out (`e`, at step `step`) means a worker was lost while
/// every PS stayed healthy: every PS answers, and each is at `step` or has just applied
/// it (a worker that died between its pushes to two PS leaves one a step ahead). Then the
/// PS have lost nothing, and restoring them from a checkpoint would only throw away the
/// other workers' progress. A PS that does not answer, or one at another step (restarted
/// from a checkpoint), is a PS failure, recovered from as such.
async fn lost_worker(worker: &Worker, step: u64, e: &WorkerError) -> bool {
    if !matches!(e, WorkerError::Timeout { .. }) {
        return false;
    }
    match worker.stats().await {
        Ok(stats) => stats.iter().all(|s| s.step == step || s.step == step + 1),
        Err(_) => false,
    }
}

/// A distributed worker: variables on the PS of `spec`, sync steps, recovery after a PS
/// restart. Worker 0 restores every PS to the newest common checkpoint (`Worker::recover`);
/// the others wait until the PS agree on a step. Both resume at that step, and since the
/// minibatch depends only on the step, no step is lost or applied twice.
/// With `ticks`, it also prints `tick K` after every step, for `ibex demo`'s progress bar.
pub async fn run_worker(
    spec: &ClusterSpec,
    index: usize,
    args: &TrainArgs,
    ticks: bool,
) -> Result<Report, String> {
    let workers = spec.workers.len();
    if index >= workers {
        return Err(format!(
            "worker index {index} is out of range: the spec lists {workers} workers"
        ));
    }
    let job = Job::new(args, workers)?;
    let vars = job.var_specs(args);
    let names: Vec<&str> = Mlp::NAMES.to_vec();
    let mut worker = connect(spec, index, &vars)
        .await
        .map_err(|e| e.to_string())?;
    let mut step = match worker.current_step().await {
        Ok(s) => s,
        // The PS disagree: a previous run died mid-recovery. Only worker 0 restores.
        Err(_) => resume_step(&worker, index, Instant::now() + spec.timeouts.call)
            .await
            .map_err(|e| e.to_string())?,
    };
    let mut params = worker.pull(&names, step).await.map_err(|e| e.to_string())?;
    job.mlp.check(&params)?;
    let mut gpu = Trainer::open(job.mlp, args.device, args.batch / workers)?;
    if let Some(g) = &mut gpu {
        g.load(&params)?;
    }
    let initial = (step == 0).then(|| params.clone());
    let (mut losses, mut recoveries) = (Vec::new(), 0u32);
    let (t0, first_step) = (Instant::now(), step);
    while step < args.steps {
        let batch = job.train.gather(&job.schedule.shard(step, index, workers));
        let (loss, result) = match &mut gpu {
            // Device parameters are updated in place; `params` is refreshed at the end.
            Some(g) => match g.step(&worker, step, &batch).await {
                Ok(loss) => (loss, Ok(None)),
                Err(e) => (0.0, Err(e)),
            },
            None if !args.overlap => {
                let (loss, grads) = job.mlp.loss_and_grad(&params, &batch);
                let pairs: Vec<(&str, &[f32])> = names
                    .iter()
                    .copied()
                    .zip(grads.iter().map(Vec::as_slice))
                    .collect();
                (loss, worker.push_pull(step, &pairs).await.map(Some))
            }
            None => {
                let (loss, r) = overlapped_step(&job, &worker, step, &params, &batch).await;
                (loss, r.map(Some))
            }
        };
        match result {
            Ok(fresh) => {
                if let Some(fresh) = fresh {
                    params = fresh;
                }
                log_step(args, step, loss, &mut losses);
                step += 1;
                if ticks {
                    println!("tick {step}");
                }
            }
            Err(e) if lost_worker(&worker, step, &e).await => {
                return Err(format!(
                    "worker {index}: step {step}: a worker was lost: {e}. Every PS is healthy \
                     and keeps its state (nothing was rolled back); restart the workers with \
                     the same flags to go on"
                ));
            }
            Err(e) if recoverable(&e) && recoveries < MAX_RECOVERIES => {
                recoveries += 1;
                let wait = restart_wait(args)?;
                if matches!(e, WorkerError::StaleStep { .. }) {
                    // The PS moved on without this worker (restored, or a step completed
                    // without it under --on-worker-loss continue): catch up with them.
                    eprintln!(
                        "worker {index}: step {step}: {e}; resuming at the PS's step (within {wait:?})"
                    );
                } else {
                    eprintln!(
                        "worker {index}: step {step}: {e}; waiting up to {wait:?} for the PS to \
                         come back (--ps-restart-wait-secs), then resuming from its checkpoint"
                    );
                }
                drop(worker);
                let (w, s) = reconnect_and_resume(spec, index, &vars, wait, &e).await?;
                params = w.pull(&names, s).await.map_err(|e| e.to_string())?;
                if let Some(g) = &mut gpu {
                    g.load(&params)?;
                }
                println!("recovered at step {s} (was at {step})");
                (worker, step) = (w, s);
            }
            Err(e) => return Err(format!("worker {index}: step {step}: {e}")),
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    if let Some(g) = &gpu {
        params = g.params()?;
    }
    let mut r = job.finish(workers, step, losses, params);
    r.steps_per_sec = (step - first_step) as f64 / secs.max(1e-9);
    r.recoveries = recoveries;
    r.initial = initial;
    r.comm_profile = worker.comm_profile().to_string();
    Ok(r)
}

async fn connect(
    spec: &ClusterSpec,
    index: usize,
    vars: &[VarSpec],
) -> Result<Arc<Worker>, WorkerError> {
    let config = ibex_worker::transport_config().map_err(|e| WorkerError::Usage(e.to_string()))?;
    let w = Worker::connect(spec, index, &config).await?;
    // Every worker creates the same list: identical specs are a no-op on the PS, and each
    // Worker needs the placement to know where a variable lives.
    w.create_variables(vars).await?;
    Ok(Arc::new(w))
}

/// One step with the output layer's gradients on the wire while the hidden layer's are
/// computed (backpropagation order), then the next step's values.
async fn overlapped_step(
    job: &Job,
    worker: &Arc<Worker>,
    step: u64,
    params: &Params,
    batch: &Dataset,
) -> (f32, Result<Params, WorkerError>) {
    let [w1, b1, w2, b2] = Mlp::NAMES;
    let f = job.mlp.forward(params, batch);
    let sent = async {
        let mut push = worker.begin_step(step);
        let (gw2, gb2) = job.mlp.backward_output(&f);
        push.push(vec![(w2.into(), gw2), (b2.into(), gb2)])?;
        let (gw1, gb1) = job.mlp.backward_hidden(params, batch, &f);
        push.push(vec![(w1.into(), gw1), (b1.into(), gb1)])?;
        push.finish_pull(&Mlp::NAMES).await
    };
    (f.loss, sent.await)
}

/// `--ps-restart-wait-secs`, checked.
fn restart_wait(args: &TrainArgs) -> Result<Duration, String> {
    Duration::try_from_secs_f64(args.ps_restart_wait_secs).map_err(|_| {
        format!(
            "--ps-restart-wait-secs {} is not a number of seconds (examples: 60, 0)",
            args.ps_restart_wait_secs
        )
    })
}

/// The step to continue from on a fresh connection after a failure; a worker other than 0
/// waits for the PS to agree until `deadline`.
async fn resume_step(w: &Worker, index: usize, deadline: Instant) -> Result<u64, WorkerError> {
    if index == 0 {
        return w.recover().await;
    }
    // Give worker 0 time to restore first: a step the PS agree on before that restore may
    // be rolled back by it (the sync timeout would then bring this worker round again).
    tokio::time::sleep(
        Duration::from_secs(1).min(deadline.saturating_duration_since(Instant::now())),
    )
    .await;
    loop {
        match w.current_step().await {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Connects afresh and finds the step to resume from, trying until `wait` has passed: the
/// time a failed PS has to be restarted (with `--restore`).
async fn reconnect_and_resume(
    spec: &ClusterSpec,
    index: usize,
    vars: &[VarSpec],
    wait: Duration,
    cause: &WorkerError,
) -> Result<(Arc<Worker>, u64), String> {
    let deadline = Instant::now() + wait;
    let mut last = cause.to_string();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300).min(left)).await;
        // Each attempt within what is left of the wait.
        let mut within = spec.clone();
        within.timeouts.connect = within
            .timeouts
            .connect
            .min(deadline.saturating_duration_since(Instant::now()))
            .max(Duration::from_millis(1));
        let w = match connect(&within, index, vars).await {
            Ok(w) => w,
            Err(e) => {
                last = e.to_string();
                continue;
            }
        };
        match resume_step(&w, index, deadline).await {
            Ok(s) => return Ok((w, s)),
            Err(e) => last = e.to_string(),
        }
    }
    Err(format!(
        "worker {index}: the PS did not come back within {wait:?}: {last}; restart the lost \
         PS with `--restore` (it resumes from its newest checkpoint) and the workers with it, \
         or raise --ps-restart-wait-secs"
    ))
}

/// How close a distributed run must come to the single-process reference: the PS averages
/// per-worker mean gradients while the reference takes one full-batch mean, so f32 sums run
/// in a different order and the weights drift apart by rounding only.
pub const MATCH_TOLERANCE: f32 = 1e-4;

/// Largest relative difference between two parameter sets: `|a-b| / max(|b|, 1e-3)`, so
/// that weights near zero are compared absolutely.
pub fn max_rel_diff(a: &Params, b: &Params) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
        .fold(0.0, f32::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(steps: u64) -> TrainArgs {
        TrainArgs {
            steps,
            batch: 64,
            lr: 0.05,
            momentum: 0.9,
            hidden: 64,
            seed: 1,
            test_size: 300,
            mnist: None,
            log_every: 1000,
            overlap: false,
            device: Device::Cpu,
            ps_restart_wait_secs: 60.0,
        }
    }

    #[test]
    fn reference_reaches_the_accuracy_bar() {
        let r = run_reference(&args(300), None).unwrap();
        assert!(r.test_accuracy >= 0.9, "accuracy {}", r.test_accuracy);
        assert_eq!(r.steps, 300);
        // Same seed, same result, bit for bit.
        let r2 = run_reference(&args(300), r.initial.clone()).unwrap();
        assert_eq!(max_rel_diff(&r.params, &r2.params), 0.0);
    }

    #[test]
    fn uneven_worker_shares_are_refused() {
        let mut a = args(1);
        a.batch = 63;
        assert!(Job::new(&a, 2).err().unwrap().contains("multiple"));
    }
}
