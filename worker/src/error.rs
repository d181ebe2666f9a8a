//! Typed worker errors: each PS status code that a training loop may want to act on has its
//! own variant, and each names the PS it came from.

/// What went wrong in a worker call.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// PS `ps` cannot be reached (not up yet, gone, or shutting down).
    #[error(
        "PS {ps} is unavailable: {source}; check that it runs and listens on the spec's address"
    )]
    Unavailable {
        /// Which PS.
        ps: usize,
        /// Why.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The variable was never created through this worker (`create_variables`), or a PS
    /// does not know it (NOT_FOUND).
    #[error("unknown variable {name:?}: create it with create_variables first")]
    UnknownVariable {
        /// The name, or the PS's message.
        name: String,
    },
    /// A tensor's element count or shape does not match the variable.
    #[error("shape mismatch for {name:?}: expected {expected} elements, got {got}")]
    ShapeMismatch {
        /// Variable.
        name: String,
        /// Elements expected.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// The PS has already applied that step (FAILED_PRECONDITION), or this worker pushed it twice.
    #[error("stale step at PS {ps}: {message}")]
    StaleStep {
        /// Which PS.
        ps: usize,
        /// The PS's message.
        message: String,
    },
    /// A sync step did not complete in time: some worker has not pushed (DEADLINE_EXCEEDED).
    #[error("timeout at PS {ps}: {message}")]
    Timeout {
        /// Which PS.
        ps: usize,
        /// The PS's message (names the step and the missing workers).
        message: String,
    },
    /// PS `ps` did not answer a call, or could not be reached, within the deadline that
    /// `setting` sets: it is stalled, overloaded, or gone without a word.
    #[error(
        "PS {ps} at {server}: {call} got no answer within {after:?}; check that the PS runs \
         and is not stalled, or raise {setting}"
    )]
    Deadline {
        /// Which PS.
        ps: usize,
        /// Its address.
        server: String,
        /// The RPC (`Stats`, `PushPull`, ...), or `connect`.
        call: String,
        /// The deadline that passed.
        after: std::time::Duration,
        /// What sets that deadline.
        setting: &'static str,
    },
    /// The PS rejected the request as malformed (INVALID_ARGUMENT, OUT_OF_RANGE, ALREADY_EXISTS).
    #[error("PS {ps} rejected the request ({code:?}): {message}")]
    Rejected {
        /// Which PS.
        ps: usize,
        /// The gRPC code.
        code: tonic::Code,
        /// The PS's message.
        message: String,
    },
    /// Any other status from PS `ps`.
    #[error("PS {ps} failed ({code:?}): {message}")]
    Rpc {
        /// Which PS.
        ps: usize,
        /// The gRPC code.
        code: tonic::Code,
        /// The PS's message.
        message: String,
    },
    /// The Ibex transport failed outside a call (exposing a buffer).
    #[error("transport: {0}")]
    Transport(#[from] ibex_transport::Error),
    /// A registered gradient buffer is still held: by a push whose RPC has not returned (the
    /// PS may still read it) or by another staging lease. `Worker::stage` waits instead.
    #[error(
        "the staging buffer of {name:?} is still in use by a push in flight or another lease; wait with Worker::stage"
    )]
    BufferBusy {
        /// The variable.
        name: String,
    },
    /// The CUDA driver library (`libcuda.so`) cannot be loaded, or lacks a function Ibex needs.
    #[error(
        "no usable CUDA driver: {detail}; install the NVIDIA driver (it provides libcuda.so.1) and make sure \
         the dynamic loader finds it (ldconfig or LD_LIBRARY_PATH), or run on the CPU (--device cpu)"
    )]
    NoCudaDriver {
        /// What was searched or what is missing.
        detail: String,
    },
    /// The driver loaded but there is no (such) CUDA device.
    #[error(
        "no CUDA device: {detail}; check nvidia-smi and CUDA_VISIBLE_DEVICES, or run on the CPU (--device cpu)"
    )]
    NoCudaDevice {
        /// Device count, ordinal asked for, or the driver's code.
        detail: String,
    },
    /// A device or pinned-host allocation failed for lack of memory.
    #[error(
        "CUDA out of memory in {op} ({bytes} B requested); free GPU memory or use smaller tensors"
    )]
    CudaOutOfMemory {
        /// What was being allocated.
        op: String,
        /// Bytes requested.
        bytes: usize,
    },
    /// Any other CUDA driver, cuBLAS or NVRTC failure.
    #[error("CUDA call {op} failed: {code}")]
    Cuda {
        /// The operation.
        op: String,
        /// The driver's error code name (or the library's message).
        code: String,
    },
    /// Misuse of the API (bad arguments that never reach a PS).
    #[error("{0}")]
    Usage(String),
}

impl WorkerError {
    pub(crate) fn from_status(ps: usize, s: tonic::Status) -> WorkerError {
        let message = s.message().to_string();
        match s.code() {
            tonic::Code::Unavailable => WorkerError::Unavailable {
                ps,
                source: message.into(),
            },
            tonic::Code::NotFound => WorkerError::UnknownVariable { name: message },
            tonic::Code::FailedPrecondition => WorkerError::StaleStep { ps, message },
            tonic::Code::DeadlineExceeded => WorkerError::Timeout { ps, message },
            code @ (tonic::Code::InvalidArgument
            | tonic::Code::OutOfRange
            | tonic::Code::AlreadyExists) => WorkerError::Rejected { ps, code, message },
            code => WorkerError::Rpc { ps, code, message },
        }
    }

    /// A sync PS refuses a second gradient for a variable whose part of step `step` it has
    /// already applied, saying the step "was already applied". When the shard itself is
    /// still at or before `step` (the step is open, waiting for other variables), the
    /// caller pushed that variable twice in one step: say so, and what to do.
    pub(crate) fn pushed_twice(self, worker: u32, step: u64, names: &[String]) -> WorkerError {
        let WorkerError::StaleStep { ps, message } = &self else {
            return self;
        };
        let Some(now) = shard_step_of_stale(message) else {
            return self;
        };
        if now > step {
            return self;
        }
        WorkerError::StaleStep {
            ps: *ps,
            message: format!(
                "worker {worker} pushed {} twice in step {step}, which is still open (the PS \
                 waits for the step's other gradients); this push was refused. Push each \
                 variable once per step, then pull step {} for the fresh values",
                match names {
                    [one] => format!("{one:?}"),
                    _ => format!("one of {names:?}"),
                },
                step + 1
            ),
        }
    }

    /// The gRPC code behind this error, if it came from a PS.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            WorkerError::Unavailable { .. } => Some(tonic::Code::Unavailable),
            WorkerError::StaleStep { .. } => Some(tonic::Code::FailedPrecondition),
            WorkerError::Timeout { .. } | WorkerError::Deadline { .. } => {
                Some(tonic::Code::DeadlineExceeded)
            }
            WorkerError::Rejected { code, .. } | WorkerError::Rpc { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// The shard's step in the PS's "step S was already applied on shard H (now at step N)"
/// message: N.
fn shard_step_of_stale(message: &str) -> Option<u64> {
    if !message.contains("was already applied") {
        return None;
    }
    let rest = message.split("(now at step ").nth(1)?;
    rest.split(')').next()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stale(message: &str) -> WorkerError {
        WorkerError::StaleStep {
            ps: 0,
            message: message.into(),
        }
    }

    #[test]
    fn a_second_push_in_an_open_step_is_named_as_such() {
        let e = stale(
            "stale step: step 1 was already applied on shard 0 (now at step 1); pull fresh values and push step 2",
        )
        .pushed_twice(0, 1, &["w".into()]);
        let m = e.to_string();
        assert!(m.contains("pushed \"w\" twice in step 1"), "{m}");
        assert!(
            m.contains("still open") && !m.contains("was already applied"),
            "{m}"
        );
    }

    #[test]
    fn a_push_behind_the_shard_keeps_the_ps_message() {
        let msg = "stale step: step 1 was already applied on shard 0 (now at step 3); pull fresh values and push step 3";
        let m = stale(msg).pushed_twice(0, 1, &["w".into()]).to_string();
        assert!(m.contains(msg), "{m}");
        let other = WorkerError::Usage("x".into()).pushed_twice(0, 1, &[]);
        assert_eq!(other.to_string(), "x");
    }
}
