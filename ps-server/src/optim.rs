//! Optimizers applied server-side to averaged gradients. Math is f32, as in TensorFlow's
//! CPU kernels; slot vectors (momentum, accumulators, moments) live next to the weights.

use ibex_proto::ps::v1 as pb;

/// An optimizer with validated hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optim {
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

impl Optim {
    /// Validates the protobuf form; the error says what is wrong.
    pub fn from_pb(o: Option<&pb::Optimizer>) -> Result<Optim, String> {
        use pb::optimizer::Kind;
        let kind = o
            .and_then(|o| o.kind.as_ref())
            .ok_or("no optimizer given: set sgd, momentum, adagrad or adam")?;
        let o = match *kind {
            Kind::Sgd(pb::Sgd { lr }) => Optim::Sgd { lr },
            Kind::Momentum(pb::Momentum { lr, momentum }) => Optim::Momentum { lr, momentum },
            Kind::Adagrad(pb::Adagrad { lr, eps }) => Optim::Adagrad { lr, eps },
            Kind::Adam(pb::Adam {
                lr,
                beta1,
                beta2,
                eps,
            }) => Optim::Adam {
                lr,
                beta1,
                beta2,
                eps,
            },
        };
        let lr = match o {
            Optim::Sgd { lr }
            | Optim::Momentum { lr, .. }
            | Optim::Adagrad { lr, .. }
            | Optim::Adam { lr, .. } => lr,
        };
        if !lr.is_finite() || lr < 0.0 {
            return Err(format!("learning rate {lr} must be finite and >= 0"));
        }
        match o {
            Optim::Momentum { momentum, .. } if !(0.0..1.0).contains(&momentum) => {
                Err(format!("momentum {momentum} must be in [0, 1)"))
            }
            Optim::Adam { beta1, beta2, .. }
                if !(0.0..1.0).contains(&beta1) || !(0.0..1.0).contains(&beta2) =>
            {
                Err(format!("Adam betas ({beta1}, {beta2}) must be in [0, 1)"))
            }
            Optim::Adagrad { eps, .. } | Optim::Adam { eps, .. }
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
            Optim::Sgd { .. } => 0,
            Optim::Momentum { .. } | Optim::Adagrad { .. } => 1,
            Optim::Adam { .. } => 2,
        }
    }

    /// Applies gradient `g` to weights `w` (same length) with `slots` (each `w.len()`
    /// long); `t` is the number of updates applied before this one.
    pub fn apply(&self, w: &mut [f32], g: &[f32], slots: &mut [Vec<f32>], t: u64) {
        match *self {
            Optim::Sgd { lr } => {
                for (w, g) in w.iter_mut().zip(g) {
                    *w -= lr * g;
                }
            }
            Optim::Momentum { lr, momentum } => {
                for ((w, g), v) in w.iter_mut().zip(g).zip(slots[0].iter_mut()) {
                    *v = momentum * *v + g;
                    *w -= lr * *v;
                }
            }
            Optim::Adagrad { lr, eps } => {
                for ((w, g), a) in w.iter_mut().zip(g).zip(slots[0].iter_mut()) {
                    *a += g * g;
                    *w -= lr * g / (a.sqrt() + eps);
                }
            }
            Optim::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                let t = (t + 1) as i32;
                let c1 = 1.0 - beta1.powi(t);
                let c2 = 1.0 - beta2.powi(t);
                let (ms, vs) = slots.split_at_mut(1);
                for (((w, g), m), v) in w
                    .iter_mut()
                    .zip(g)
                    .zip(ms[0].iter_mut())
                    .zip(vs[0].iter_mut())
                {
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    *w -= lr * (*m / c1) / ((*v / c2).sqrt() + eps);
                }
            }
        }
    }
}
