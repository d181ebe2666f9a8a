//! The connect-time threshold probe. (Being written.)

/// Sizes and repetitions the probe measures.
#[derive(Debug, Clone)]
pub struct ProbePlan {
    /// Candidate thresholds, ascending.
    pub sizes: Vec<usize>,
    /// Samples per size and protocol.
    pub reps: usize,
}
