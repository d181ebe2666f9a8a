//! The demo model: a two-layer perceptron (input -> hidden ReLU -> classes, softmax
//! cross-entropy) in plain f32, with the backward pass written out. Its four tensors are
//! the PS variables, in [`Mlp::NAMES`] order.

use crate::data::Dataset;
use crate::rng::SplitMix64;

/// Layer sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mlp {
    /// Input features.
    pub input: usize,
    /// Hidden units.
    pub hidden: usize,
    /// Output classes.
    pub classes: usize,
}

/// What the forward pass over a batch leaves for the backward pass.
#[derive(Debug, Clone)]
pub struct Forward {
    n: usize,
    /// Hidden activations, `n x hidden`.
    h: Vec<f32>,
    /// dLoss/dLogits of the batch mean, `n x classes`.
    dz: Vec<f32>,
    /// Mean loss over the batch.
    pub loss: f32,
}

/// Parameters (or gradients) in [`Mlp::NAMES`] order: `w1` is `input x hidden` row-major,
/// `w2` is `hidden x classes`.
pub type Params = Vec<Vec<f32>>;

impl Mlp {
    /// PS variable names of `w1`, `b1`, `w2`, `b2`.
    pub const NAMES: [&'static str; 4] = [
        "dense1/kernel",
        "dense1/bias",
        "dense2/kernel",
        "dense2/bias",
    ];

    /// Tensor shapes in [`Mlp::NAMES`] order.
    pub fn shapes(&self) -> [Vec<usize>; 4] {
        [
            vec![self.input, self.hidden],
            vec![self.hidden],
            vec![self.hidden, self.classes],
            vec![self.classes],
        ]
    }

    /// Glorot-uniform weights and zero biases from `seed` (used when no PS chose them).
    pub fn init(&self, seed: u64) -> Params {
        let mut rng = SplitMix64::new(seed);
        let mut glorot = |fan_in: usize, fan_out: usize| -> Vec<f32> {
            let a = (6.0 / (fan_in + fan_out) as f32).sqrt();
            (0..fan_in * fan_out)
                .map(|_| (rng.next_f32() * 2.0 - 1.0) * a)
                .collect()
        };
        let w1 = glorot(self.input, self.hidden);
        let w2 = glorot(self.hidden, self.classes);
        vec![w1, vec![0.0; self.hidden], w2, vec![0.0; self.classes]]
    }

    /// Checks that `p` has this model's tensor sizes.
    pub fn check(&self, p: &Params) -> Result<(), String> {
        let want: Vec<usize> = self.shapes().iter().map(|s| s.iter().product()).collect();
        let got: Vec<usize> = p.iter().map(Vec::len).collect();
        if want != got {
            return Err(format!(
                "parameter sizes {got:?} do not match the model's {want:?}"
            ));
        }
        Ok(())
    }

    /// Hidden activations and logits of one example.
    fn forward_one(&self, p: &Params, x: &[f32], h: &mut [f32], z: &mut [f32]) {
        let (w1, b1, w2, b2) = (&p[0], &p[1], &p[2], &p[3]);
        h.copy_from_slice(b1);
        for (i, &xi) in x.iter().enumerate() {
            if xi != 0.0 {
                let row = &w1[i * self.hidden..(i + 1) * self.hidden];
                for (hj, &w) in h.iter_mut().zip(row) {
                    *hj += xi * w;
                }
            }
        }
        for hj in h.iter_mut() {
            *hj = hj.max(0.0);
        }
        z.copy_from_slice(b2);
        for (j, &hj) in h.iter().enumerate() {
            if hj != 0.0 {
                let row = &w2[j * self.classes..(j + 1) * self.classes];
                for (zk, &w) in z.iter_mut().zip(row) {
                    *zk += hj * w;
                }
            }
        }
    }

    /// Softmax of `z` in place (max-shifted); returns `-log softmax(z)[label]`.
    fn softmax_xent(z: &mut [f32], label: usize) -> f32 {
        let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for v in z.iter_mut() {
            *v = (*v - m).exp();
            sum += *v;
        }
        for v in z.iter_mut() {
            *v /= sum;
        }
        -(z[label].max(f32::MIN_POSITIVE)).ln()
    }

    /// Mean loss over `d` and its gradient with respect to every parameter.
    pub fn loss_and_grad(&self, p: &Params, d: &Dataset) -> (f32, Params) {
        let f = self.forward(p, d);
        let (gw2, gb2) = self.backward_output(&f);
        let (gw1, gb1) = self.backward_hidden(p, d, &f);
        (f.loss, vec![gw1, gb1, gw2, gb2])
    }

    /// The forward pass over the batch `d`, keeping what the backward pass needs.
    pub fn forward(&self, p: &Params, d: &Dataset) -> Forward {
        let n = d.len();
        let mut f = Forward {
            n,
            h: vec![0.0; n * self.hidden],
            dz: vec![0.0; n * self.classes],
            loss: 0.0,
        };
        if n == 0 {
            return f;
        }
        let scale = 1.0 / n as f32;
        let mut loss = 0.0f64;
        for e in 0..n {
            let h = &mut f.h[e * self.hidden..(e + 1) * self.hidden];
            let z = &mut f.dz[e * self.classes..(e + 1) * self.classes];
            self.forward_one(p, d.row(e), h, z);
            let y = usize::from(d.y[e]);
            loss += f64::from(Self::softmax_xent(z, y));
            // dL/dz = (softmax - onehot) / n for the batch mean.
            z[y] -= 1.0;
            for v in z.iter_mut() {
                *v *= scale;
            }
        }
        f.loss = (loss / n as f64) as f32;
        f
    }

    /// Gradients of the output layer (`w2`, `b2`): available first in the backward pass, so
    /// a worker can push them while it computes the hidden layer's.
    pub fn backward_output(&self, f: &Forward) -> (Vec<f32>, Vec<f32>) {
        let (mut gw2, mut gb2) = (
            vec![0.0; self.hidden * self.classes],
            vec![0.0; self.classes],
        );
        for e in 0..f.n {
            let h = &f.h[e * self.hidden..(e + 1) * self.hidden];
            let z = &f.dz[e * self.classes..(e + 1) * self.classes];
            for (b, &dz) in gb2.iter_mut().zip(z) {
                *b += dz;
            }
            for (j, &hj) in h.iter().enumerate() {
                let g2row = &mut gw2[j * self.classes..(j + 1) * self.classes];
                for (g, &dz) in g2row.iter_mut().zip(z) {
                    *g += hj * dz;
                }
            }
        }
        (gw2, gb2)
    }

    /// Gradients of the hidden layer (`w1`, `b1`), back through `w2` and the ReLU.
    pub fn backward_hidden(&self, p: &Params, d: &Dataset, f: &Forward) -> (Vec<f32>, Vec<f32>) {
        let (mut gw1, mut gb1) = (vec![0.0; self.input * self.hidden], vec![0.0; self.hidden]);
        let mut dh = vec![0.0; self.hidden];
        for e in 0..f.n {
            let h = &f.h[e * self.hidden..(e + 1) * self.hidden];
            let z = &f.dz[e * self.classes..(e + 1) * self.classes];
            for j in 0..self.hidden {
                let w2row = &p[2][j * self.classes..(j + 1) * self.classes];
                let back: f32 = w2row.iter().zip(z).map(|(w, dz)| w * dz).sum();
                // ReLU passes the gradient only where the unit was active.
                dh[j] = if h[j] > 0.0 { back } else { 0.0 };
            }
            for (b, &v) in gb1.iter_mut().zip(&dh) {
                *b += v;
            }
            for (i, &xi) in d.row(e).iter().enumerate() {
                if xi != 0.0 {
                    let row = &mut gw1[i * self.hidden..(i + 1) * self.hidden];
                    for (gw, &v) in row.iter_mut().zip(&dh) {
                        *gw += xi * v;
                    }
                }
            }
        }
        (gw1, gb1)
    }

    /// Mean loss and accuracy over `d`.
    pub fn evaluate(&self, p: &Params, d: &Dataset) -> (f32, f32) {
        let (mut h, mut z) = (vec![0.0; self.hidden], vec![0.0; self.classes]);
        let (mut loss, mut correct) = (0.0f64, 0usize);
        for e in 0..d.len() {
            self.forward_one(p, d.row(e), &mut h, &mut z);
            let y = usize::from(d.y[e]);
            let pred = (0..self.classes).fold(0, |best, k| if z[k] > z[best] { k } else { best });
            correct += usize::from(pred == y);
            loss += f64::from(Self::softmax_xent(&mut z, y));
        }
        let n = d.len().max(1) as f64;
        ((loss / n) as f32, (correct as f64 / n) as f32)
    }
}

/// Local SGD with momentum, the update the PS applies (`v = m v + g; w -= lr v`); used by
/// the single-process reference run.
#[derive(Debug, Clone)]
pub struct LocalMomentum {
    lr: f32,
    momentum: f32,
    velocity: Params,
}

impl LocalMomentum {
    /// Zero velocity for tensors shaped like `p`.
    pub fn new(lr: f32, momentum: f32, p: &Params) -> Self {
        LocalMomentum {
            lr,
            momentum,
            velocity: p.iter().map(|t| vec![0.0; t.len()]).collect(),
        }
    }

    /// One update of `p` with gradient `g`.
    pub fn apply(&mut self, p: &mut Params, g: &Params) {
        for ((w, g), v) in p.iter_mut().zip(g).zip(&mut self.velocity) {
            for ((w, &g), v) in w.iter_mut().zip(g).zip(v.iter_mut()) {
                if self.momentum == 0.0 {
                    *w -= self.lr * g;
                } else {
                    *v = self.momentum * *v + g;
                    *w -= self.lr * *v;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> (Mlp, Params, Dataset) {
        let m = Mlp {
            input: 5,
            hidden: 4,
            classes: 3,
        };
        let mut p = m.init(3);
        // Non-zero biases so every code path carries gradient.
        p[1] = vec![0.1, -0.05, 0.2, 0.0];
        p[3] = vec![0.05, -0.1, 0.02];
        let mut rng = SplitMix64::new(9);
        let x = (0..6 * 5).map(|_| rng.next_f32()).collect();
        let d = Dataset {
            x,
            y: vec![0, 1, 2, 1, 0, 2],
            dim: 5,
            classes: 3,
        };
        (m, p, d)
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let (m, p, d) = toy();
        let (_, g) = m.loss_and_grad(&p, &d);
        let eps = 1e-2f32;
        let mut worst = 0.0f32;
        for t in 0..4 {
            for i in 0..p[t].len() {
                let mut plus = p.clone();
                plus[t][i] += eps;
                let mut minus = p.clone();
                minus[t][i] -= eps;
                // Central differences in f64 accumulation keep the f32 error small.
                let num =
                    (m.loss_and_grad(&plus, &d).0 - m.loss_and_grad(&minus, &d).0) / (2.0 * eps);
                let err = (num - g[t][i]).abs() / (num.abs() + g[t][i].abs()).max(1e-2);
                worst = worst.max(err);
                assert!(
                    err < 2e-2,
                    "tensor {t} index {i}: analytic {} numeric {num}",
                    g[t][i]
                );
            }
        }
        assert!(worst.is_finite());
    }

    #[test]
    fn half_batch_gradients_average_to_the_full_batch() {
        let (m, p, d) = toy();
        let (lf, gf) = m.loss_and_grad(&p, &d);
        let (la, ga) = m.loss_and_grad(&p, &d.gather(&[0, 1, 2]));
        let (lb, gb) = m.loss_and_grad(&p, &d.gather(&[3, 4, 5]));
        assert!(((la + lb) / 2.0 - lf).abs() < 1e-6);
        for t in 0..4 {
            for i in 0..gf[t].len() {
                assert!(((ga[t][i] + gb[t][i]) / 2.0 - gf[t][i]).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn training_lowers_the_loss() {
        let (m, mut p, d) = toy();
        let before = m.evaluate(&p, &d).0;
        let mut opt = LocalMomentum::new(0.5, 0.9, &p);
        for _ in 0..50 {
            let (_, g) = m.loss_and_grad(&p, &d);
            opt.apply(&mut p, &g);
        }
        let (after, _) = m.evaluate(&p, &d);
        assert!(after < before * 0.5, "loss {before} -> {after}");
        assert!(m.check(&p).is_ok());
        assert!(m.check(&p[..3].to_vec()).is_err());
    }
}
