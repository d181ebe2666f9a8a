//! Optimizers applied server-side to averaged gradients. Math is f32, as in TensorFlow's
//! CPU kernels; slot vectors (momentum, accumulators, moments) live next to the weights.
//! The optimizer itself ([`Optimizer`]) is defined in `ibex-proto`, shared with the worker.

pub use ibex_proto::Optimizer;

/// Applies gradient `g` to weights `w` (same length) with `slots` (each `w.len()`
/// long); `t` is the number of updates applied before this one.
pub fn apply(o: &Optimizer, w: &mut [f32], g: &[f32], slots: &mut [Vec<f32>], t: u64) {
    match *o {
        Optimizer::Sgd { lr } => {
            for (w, g) in w.iter_mut().zip(g) {
                *w -= lr * g;
            }
        }
        Optimizer::Momentum { lr, momentum } => {
            for ((w, g), v) in w.iter_mut().zip(g).zip(slots[0].iter_mut()) {
                *v = momentum * *v + g;
                *w -= lr * *v;
            }
        }
        Optimizer::Adagrad { lr, eps } => {
            for ((w, g), a) in w.iter_mut().zip(g).zip(slots[0].iter_mut()) {
                *a += g * g;
                *w -= lr * g / (a.sqrt() + eps);
            }
        }
        Optimizer::Adam {
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
