//! Overlapping communication with compute: a training step whose gradients go out layer by
//! layer while the backward pass is still computing the layers below.
//!
//! Backpropagation produces the last layer's gradients first. Waiting for the whole
//! backward pass before pushing anything leaves the network idle during it; TensorFlow's PS
//! runtime instead pushes each gradient as soon as its op finishes. [`StepPush`] does the
//! same: [`StepPush::push`] starts the push in a background task and returns at once, and
//! [`StepPush::finish_pull`] waits for every push and returns the values of the next step.
//!
//! ```no_run
//! # async fn f(w: std::sync::Arc<ibex_worker::Worker>) -> Result<(), ibex_worker::WorkerError> {
//! let mut step = w.begin_step(7);
//! step.push(vec![("dense2/kernel".into(), vec![0.0; 640]), ("dense2/bias".into(), vec![0.0; 10])])?;
//! // ... compute the first layer's gradients while those travel ...
//! step.push(vec![("dense1/kernel".into(), vec![0.0; 4096]), ("dense1/bias".into(), vec![0.0; 64])])?;
//! let fresh = step.finish_pull(&["dense1/kernel", "dense1/bias", "dense2/kernel", "dense2/bias"]).await?;
//! # Ok(()) }
//! ```
//!
//! In sync mode the PS applies a step once every worker pushed every variable, however many
//! pushes that took, so splitting a step's gradients across pushes changes nothing in the
//! result. In async mode every push is applied (and counted as a step) on arrival.

use std::sync::Arc;

use tokio::task::JoinSet;

use crate::client::{OutBuf, Worker, check_bufs};
use crate::error::WorkerError;
use crate::staging::Staged;

/// Gradients of one layer: `(variable name, values)`, owned because they travel in a
/// background task while the caller goes on computing.
pub type LayerGrads = Vec<(String, Vec<f32>)>;

/// One training step's gradients, pushed in parts as they are computed. Start it with
/// [`Worker::begin_step`].
///
/// Dropping it before [`StepPush::finish`] or [`StepPush::finish_pull`] cancels the pushes
/// still in flight; in sync mode that step then cannot complete and ends in the PS's sync
/// timeout, as a worker that died mid-step would.
#[derive(Debug)]
pub struct StepPush {
    worker: Arc<Worker>,
    step: u64,
    pushes: JoinSet<Result<(), WorkerError>>,
}

impl Worker {
    /// Starts step `step` for pushing gradients layer by layer (see [`StepPush`]). Needs a
    /// tokio runtime with worker threads to overlap with the caller's computation: on a
    /// current-thread runtime the pushes only progress while the caller awaits.
    pub fn begin_step(self: &Arc<Self>, step: u64) -> StepPush {
        StepPush {
            worker: self.clone(),
            step,
            pushes: JoinSet::new(),
        }
    }
}

impl StepPush {
    /// The step these gradients contribute to.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Pushes `grads` now, in the background, and returns at once. Unknown names and wrong
    /// sizes are reported here, before anything is sent; transport and PS errors are
    /// reported by [`StepPush::finish`].
    pub fn push(&mut self, grads: LayerGrads) -> Result<(), WorkerError> {
        for (name, g) in &grads {
            let p = self
                .worker
                .placement(name)
                .ok_or_else(|| WorkerError::UnknownVariable { name: name.clone() })?;
            if g.len() != p.spec.numel() {
                return Err(WorkerError::ShapeMismatch {
                    name: name.clone(),
                    expected: p.spec.numel(),
                    got: g.len(),
                });
            }
        }
        if grads.is_empty() {
            return Ok(());
        }
        let (worker, step) = (self.worker.clone(), self.step);
        self.pushes.spawn(async move {
            let pairs: Vec<(&str, &[f32])> = grads
                .iter()
                .map(|(n, g)| (n.as_str(), g.as_slice()))
                .collect();
            worker.push(step, &pairs).await
        });
        Ok(())
    }

    /// Pushes the registered buffers of `staged` now, in the background, and returns at
    /// once: the layer's gradients were written into the lease (see [`Worker::stage`]), so
    /// nothing is copied on the worker. Errors are reported by [`StepPush::finish`].
    pub fn push_staged(&mut self, staged: Staged) {
        let (worker, step) = (self.worker.clone(), self.step);
        self.pushes
            .spawn(async move { worker.push_staged(step, staged).await });
    }

    /// As [`StepPush::finish_pull`], with the values read straight into caller memory
    /// (`out[i]` for `names[i]`), as [`Worker::pull_into_bufs`] does.
    pub async fn finish_pull_into_bufs(
        self,
        names: &[&str],
        out: &[OutBuf],
    ) -> Result<(), WorkerError> {
        let worker = self.worker.clone();
        if let Err(e) = check_bufs(&worker, names.iter().copied(), out) {
            self.finish().await?;
            return Err(e);
        }
        self.finish_and(|next| async move { worker.pull_into_bufs(names, next, out).await })
            .await
    }

    /// Waits until every push of this step was accepted by its PS (sync mode: before the
    /// step is necessarily applied). The first error wins; the other pushes still finish.
    pub async fn finish(mut self) -> Result<(), WorkerError> {
        let mut first = None;
        while let Some(r) = self.pushes.join_next().await {
            let r =
                r.map_err(|e| WorkerError::Usage(format!("a background push task failed: {e}")));
            if let Err(e) = r.and_then(|x| x)
                && first.is_none()
            {
                first = Some(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Waits for every push, and returns the values of `names` once step `step` has been
    /// applied (sync mode), i.e. the parameters for the next step. The pull is sent at once
    /// and waits at the PS, so it costs no extra round trip after the last push lands.
    pub async fn finish_pull(self, names: &[&str]) -> Result<Vec<Vec<f32>>, WorkerError> {
        let worker = self.worker.clone();
        self.finish_and(|next| async move { worker.pull(names, next).await })
            .await
    }

    /// Waits for every push, and meanwhile runs `pull` for the next step, as the pulls
    /// above do: sent at once, it waits at the PS, so it costs no extra round trip after
    /// the last push lands.
    async fn finish_and<T, F>(self, pull: impl FnOnce(u64) -> F) -> Result<T, WorkerError>
    where
        F: std::future::Future<Output = Result<T, WorkerError>>,
    {
        // The PS refuses a step of u64::MAX too; saying so here names the caller's mistake.
        let Some(next) = self.step.checked_add(1) else {
            let step = self.step;
            // The pushes still land, as they would if only the pull failed.
            self.finish().await?;
            return Err(WorkerError::Usage(format!(
                "step {step} has no next step to pull; number steps below u64::MAX"
            )));
        };
        let pushed = self.finish();
        let pull = pull(next);
        tokio::pin!(pushed, pull);
        tokio::select! {
            // A failed push means the step can never be applied: give up on the pull
            // (dropping it cancels the call) instead of waiting for the PS's sync timeout.
            r = &mut pushed => {
                r?;
                pull.await
            }
            v = &mut pull => {
                let v = v?;
                pushed.await?;
                Ok(v)
            }
        }
    }
}
