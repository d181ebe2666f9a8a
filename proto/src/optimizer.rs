//! The optimizer description shared by the worker and the parameter server.

use crate::ps::v1 as pb;

/// The optimizer a parameter server applies to a variable's averaged gradients: the one
/// definition the worker (which chooses it) and the PS (which validates and runs it) share.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// w -= lr * g
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// v = momentum * v + g; w -= lr * v (TensorFlow's MomentumOptimizer, not Nesterov).
    Momentum {
        /// Learning rate.
        lr: f32,
        /// Momentum.
        momentum: f32,
    },
    /// a += g²; w -= lr * g / (sqrt(a) + eps); the accumulator starts at 0.
    Adagrad {
        /// Learning rate.
        lr: f32,
        /// Added to the denominator.
        eps: f32,
    },
    /// Adam, Kingma & Ba Algorithm 1: bias-corrected moments, t counts this variable's updates.
    Adam {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the denominator.
        eps: f32,
    },
}

impl Optimizer {
    /// Validates the protobuf form; the error says what is wrong.
    pub fn from_pb(o: Option<&pb::Optimizer>) -> Result<Optimizer, String> {
        use pb::optimizer::Kind;
        let kind = o
            .and_then(|o| o.kind.as_ref())
            .ok_or("no optimizer given: set sgd, momentum, adagrad or adam")?;
        let o = match *kind {
            Kind::Sgd(pb::Sgd { lr }) => Optimizer::Sgd { lr },
            Kind::Momentum(pb::Momentum { lr, momentum }) => Optimizer::Momentum { lr, momentum },
            Kind::Adagrad(pb::Adagrad { lr, eps }) => Optimizer::Adagrad { lr, eps },
            Kind::Adam(pb::Adam {
                lr,
                beta1,
                beta2,
                eps,
            }) => Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            },
        };
        let lr = match o {
            Optimizer::Sgd { lr }
            | Optimizer::Momentum { lr, .. }
            | Optimizer::Adagrad { lr, .. }
            | Optimizer::Adam { lr, .. } => lr,
        };
        if !lr.is_finite() || lr < 0.0 {
            return Err(format!("learning rate {lr} must be finite and >= 0"));
        }
        match o {
            Optimizer::Momentum { momentum, .. } if !(0.0..1.0).contains(&momentum) => {
                Err(format!("momentum {momentum} must be in [0, 1)"))
            }
            Optimizer::Adam { beta1, beta2, .. }
                if !(0.0..1.0).contains(&beta1) || !(0.0..1.0).contains(&beta2) =>
            {
                Err(format!("Adam betas ({beta1}, {beta2}) must be in [0, 1)"))
            }
            Optimizer::Adagrad { eps, .. } | Optimizer::Adam { eps, .. }
                if !(eps.is_finite() && eps >= 0.0) =>
            {
                Err(format!("eps {eps} must be finite and >= 0"))
            }
            o => Ok(o),
        }
    }

    /// Slot vectors this optimizer keeps per weight.
    pub fn num_slots(&self) -> usize {
        match self {
            Optimizer::Sgd { .. } => 0,
            Optimizer::Momentum { .. } | Optimizer::Adagrad { .. } => 1,
            Optimizer::Adam { .. } => 2,
        }
    }

    /// The protobuf form.
    pub fn to_pb(self) -> pb::Optimizer {
        use pb::optimizer::Kind;
        let kind = match self {
            Optimizer::Sgd { lr } => Kind::Sgd(pb::Sgd { lr }),
            Optimizer::Momentum { lr, momentum } => Kind::Momentum(pb::Momentum { lr, momentum }),
            Optimizer::Adagrad { lr, eps } => Kind::Adagrad(pb::Adagrad { lr, eps }),
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => Kind::Adam(pb::Adam {
                lr,
                beta1,
                beta2,
                eps,
            }),
        };
        pb::Optimizer { kind: Some(kind) }
    }
}
