//! Trainable variables of the CNNs that `ps-step` exchanges, generated from each architecture's
//! layer definition (not typed in as a table), in TensorFlow's layouts: conv kernels
//! `[kh, kw, in, out]`, dense kernels `[in, out]`, vectors for biases and batch-norm
//! `gamma`/`beta`. Batch-norm moving mean and variance are not trainable (the PS holds them,
//! but no worker pushes gradients for them), so they are not listed.
//!
//! Sources, with the published parameter counts the unit tests check:
//! - ResNet-50 v1.5: torchvision `resnet50` / TF official models `resnet` (stride on the 3x3
//!   conv of each bottleneck; convs without bias, each followed by batch norm). 53 convs,
//!   53 batch norms, FC: 161 tensors, 25,557,032 parameters.
//! - VGG-16: Simonyan & Zisserman configuration D, torchvision `vgg16` / Keras `VGG16`
//!   (13 convs and 3 FC layers, all with bias): 32 tensors, 138,357,544 parameters.
//! - Inception-v3: torchvision `inception_v3` (Szegedy et al. 2015; every `BasicConv2d` is a
//!   conv without bias plus batch norm with gamma and beta). Without the auxiliary head (what
//!   `ps-step` uses): 94 convs, 284 tensors, 23,834,568 parameters; Keras `InceptionV3`
//!   reports 23,851,784 = these minus the 17,216 gammas (its batch norms have `scale=False`)
//!   plus 34,432 moving means and variances. With torchvision's auxiliary head
//!   (`aux_logits=True`, its default): 292 tensors, 27,161,264 parameters.
//! - WRN-16-4 for CIFAR-10: Zagoruyko & Komodakis 2016, "Wide Residual Networks" (2.7M
//!   parameters in their table 1), as in their reference code: pre-activation basic blocks
//!   (batch norm, ReLU, 3x3 conv, twice), convs without bias, a 1x1 projection where the
//!   width changes, a final batch norm and a 10-way FC. 44 tensors, 2,748,890 parameters. A
//!   small real model: what fits eight workers in the 2 GiB Soft-RoCE VM, while its wide
//!   layers (up to 2.4 MB) still travel one-sided.

use clap::ValueEnum;

/// A model whose variables `ps-step` exchanges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Model {
    /// ResNet-50 v1.5: 161 tensors, 25.6M parameters.
    Resnet50,
    /// VGG-16: 32 tensors, 138.4M parameters.
    Vgg16,
    /// Inception-v3 without the auxiliary head: 284 tensors, 23.8M parameters.
    Inception3,
    /// WRN-16-4 (CIFAR-10): 44 tensors, 2.7M parameters.
    #[value(name = "wrn16-4")]
    Wrn16x4,
}

impl Model {
    /// The name on the command line and in records.
    pub fn name(self) -> &'static str {
        match self {
            Model::Resnet50 => "resnet50",
            Model::Vgg16 => "vgg16",
            Model::Inception3 => "inception3",
            Model::Wrn16x4 => "wrn16-4",
        }
    }

    /// The model's trainable variables, in the order a TF graph creates them.
    pub fn variables(self) -> Vec<Var> {
        match self {
            Model::Resnet50 => resnet50(),
            Model::Vgg16 => vgg16(),
            Model::Inception3 => inception3(false),
            Model::Wrn16x4 => wrn(16, 4, 10),
        }
    }
}

/// One trainable variable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Var {
    /// `layer/kernel`, `layer/bias`, `layer/bn/gamma`, ...
    pub name: String,
    /// TF layout (see the module docs).
    pub shape: Vec<usize>,
}

impl Var {
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Parameters in a variable list.
pub fn params(vars: &[Var]) -> usize {
    vars.iter().map(Var::numel).sum()
}

#[derive(Default)]
struct Net(Vec<Var>);

impl Net {
    fn var(&mut self, name: String, shape: Vec<usize>) {
        self.0.push(Var { name, shape });
    }
    /// A conv with bias (VGG).
    fn conv_bias(&mut self, name: &str, k: usize, cin: usize, cout: usize) {
        self.var(format!("{name}/kernel"), vec![k, k, cin, cout]);
        self.var(format!("{name}/bias"), vec![cout]);
    }
    /// A conv without bias followed by batch norm (ResNet, Inception's `BasicConv2d`).
    fn conv_bn(&mut self, name: &str, (kh, kw): (usize, usize), cin: usize, cout: usize) {
        self.var(format!("{name}/kernel"), vec![kh, kw, cin, cout]);
        self.var(format!("{name}/bn/gamma"), vec![cout]);
        self.var(format!("{name}/bn/beta"), vec![cout]);
    }
    /// Batch norm's trainable pair (pre-activation nets put it before the conv).
    fn bn(&mut self, name: &str, c: usize) {
        self.var(format!("{name}/gamma"), vec![c]);
        self.var(format!("{name}/beta"), vec![c]);
    }
    fn dense(&mut self, name: &str, cin: usize, cout: usize) {
        self.var(format!("{name}/kernel"), vec![cin, cout]);
        self.var(format!("{name}/bias"), vec![cout]);
    }
}

const CLASSES: usize = 1000;

/// A wide ResNet WRN-`depth`-`k` for 32x32 images: a 3x3 stem of 16, three groups of
/// `(depth - 4) / 6` pre-activation blocks of widths 16k, 32k, 64k, final batch norm, FC.
fn wrn(depth: usize, k: usize, classes: usize) -> Vec<Var> {
    let mut n = Net::default();
    n.var("conv1/kernel".into(), vec![3, 3, 3, 16]);
    let blocks = (depth - 4) / 6;
    let mut cin = 16;
    for (g, width) in [16 * k, 32 * k, 64 * k].into_iter().enumerate() {
        for b in 0..blocks {
            let p = format!("group{}.{b}", g + 1);
            n.bn(&format!("{p}.bn1"), cin);
            n.var(format!("{p}.conv1/kernel"), vec![3, 3, cin, width]);
            n.bn(&format!("{p}.bn2"), width);
            n.var(format!("{p}.conv2/kernel"), vec![3, 3, width, width]);
            if cin != width {
                n.var(format!("{p}.shortcut/kernel"), vec![1, 1, cin, width]);
            }
            cin = width;
        }
    }
    n.bn("bn", cin);
    n.dense("fc", cin, classes);
    n.0
}

/// ResNet-50 v1.5: stem, bottleneck stages of 3, 4, 6, 3 blocks (widths 64..512, expansion 4,
/// a projection shortcut on each stage's first block), global pool, FC.
fn resnet50() -> Vec<Var> {
    let mut n = Net::default();
    n.conv_bn("conv1", (7, 7), 3, 64);
    let mut cin = 64;
    for (stage, (blocks, width)) in [(3, 64), (4, 128), (6, 256), (3, 512)]
        .into_iter()
        .enumerate()
    {
        for b in 0..blocks {
            let p = format!("layer{}.{b}", stage + 1);
            n.conv_bn(&format!("{p}.conv1"), (1, 1), cin, width);
            n.conv_bn(&format!("{p}.conv2"), (3, 3), width, width);
            n.conv_bn(&format!("{p}.conv3"), (1, 1), width, 4 * width);
            if b == 0 {
                n.conv_bn(&format!("{p}.downsample"), (1, 1), cin, 4 * width);
            }
            cin = 4 * width;
        }
    }
    n.dense("fc", cin, CLASSES);
    n.0
}

/// VGG-16 (configuration D): 3x3 convs 64,64 | 128,128 | 256x3 | 512x3 | 512x3, pooling
/// between groups, then FC 25088 (7x7x512) -> 4096 -> 4096 -> 1000.
fn vgg16() -> Vec<Var> {
    let mut n = Net::default();
    let mut cin = 3;
    for (g, (convs, width)) in [(2, 64), (2, 128), (3, 256), (3, 512), (3, 512)]
        .into_iter()
        .enumerate()
    {
        for c in 0..convs {
            n.conv_bias(&format!("conv{}_{}", g + 1, c + 1), 3, cin, width);
            cin = width;
        }
    }
    n.dense("fc6", 7 * 7 * cin, 4096);
    n.dense("fc7", 4096, 4096);
    n.dense("fc8", 4096, CLASSES);
    n.0
}

/// Inception-v3 as torchvision defines it; `aux` adds the auxiliary classifier on Mixed_6e.
fn inception3(aux: bool) -> Vec<Var> {
    let mut n = Net::default();
    let sq = |k: usize| (k, k);
    n.conv_bn("Conv2d_1a_3x3", sq(3), 3, 32);
    n.conv_bn("Conv2d_2a_3x3", sq(3), 32, 32);
    n.conv_bn("Conv2d_2b_3x3", sq(3), 32, 64);
    n.conv_bn("Conv2d_3b_1x1", sq(1), 64, 80);
    n.conv_bn("Conv2d_4a_3x3", sq(3), 80, 192);
    // InceptionA: 1x1 | 1x1 -> 5x5 | 1x1 -> 3x3 -> 3x3 | pool -> 1x1.
    let mut cin = 192;
    for (name, pool) in [("Mixed_5b", 32), ("Mixed_5c", 64), ("Mixed_5d", 64)] {
        n.conv_bn(&format!("{name}.branch1x1"), sq(1), cin, 64);
        n.conv_bn(&format!("{name}.branch5x5_1"), sq(1), cin, 48);
        n.conv_bn(&format!("{name}.branch5x5_2"), sq(5), 48, 64);
        n.conv_bn(&format!("{name}.branch3x3dbl_1"), sq(1), cin, 64);
        n.conv_bn(&format!("{name}.branch3x3dbl_2"), sq(3), 64, 96);
        n.conv_bn(&format!("{name}.branch3x3dbl_3"), sq(3), 96, 96);
        n.conv_bn(&format!("{name}.branch_pool"), sq(1), cin, pool);
        cin = 64 + 64 + 96 + pool;
    }
    // InceptionB (grid reduction 35 -> 17): 3x3/2 | 1x1 -> 3x3 -> 3x3/2 | max pool.
    n.conv_bn("Mixed_6a.branch3x3", sq(3), cin, 384);
    n.conv_bn("Mixed_6a.branch3x3dbl_1", sq(1), cin, 64);
    n.conv_bn("Mixed_6a.branch3x3dbl_2", sq(3), 64, 96);
    n.conv_bn("Mixed_6a.branch3x3dbl_3", sq(3), 96, 96);
    cin += 384 + 96;
    // InceptionC: factorized 7x7 convolutions with c7 inner channels.
    for (name, c7) in [
        ("Mixed_6b", 128),
        ("Mixed_6c", 160),
        ("Mixed_6d", 160),
        ("Mixed_6e", 192),
    ] {
        n.conv_bn(&format!("{name}.branch1x1"), sq(1), cin, 192);
        n.conv_bn(&format!("{name}.branch7x7_1"), sq(1), cin, c7);
        n.conv_bn(&format!("{name}.branch7x7_2"), (1, 7), c7, c7);
        n.conv_bn(&format!("{name}.branch7x7_3"), (7, 1), c7, 192);
        n.conv_bn(&format!("{name}.branch7x7dbl_1"), sq(1), cin, c7);
        n.conv_bn(&format!("{name}.branch7x7dbl_2"), (7, 1), c7, c7);
        n.conv_bn(&format!("{name}.branch7x7dbl_3"), (1, 7), c7, c7);
        n.conv_bn(&format!("{name}.branch7x7dbl_4"), (7, 1), c7, c7);
        n.conv_bn(&format!("{name}.branch7x7dbl_5"), (1, 7), c7, 192);
        n.conv_bn(&format!("{name}.branch_pool"), sq(1), cin, 192);
        cin = 4 * 192;
    }
    if aux {
        n.conv_bn("AuxLogits.conv0", sq(1), cin, 128);
        n.conv_bn("AuxLogits.conv1", sq(5), 128, 768);
        n.dense("AuxLogits.fc", 768, CLASSES);
    }
    // InceptionD (grid reduction 17 -> 8).
    n.conv_bn("Mixed_7a.branch3x3_1", sq(1), cin, 192);
    n.conv_bn("Mixed_7a.branch3x3_2", sq(3), 192, 320);
    n.conv_bn("Mixed_7a.branch7x7x3_1", sq(1), cin, 192);
    n.conv_bn("Mixed_7a.branch7x7x3_2", (1, 7), 192, 192);
    n.conv_bn("Mixed_7a.branch7x7x3_3", (7, 1), 192, 192);
    n.conv_bn("Mixed_7a.branch7x7x3_4", sq(3), 192, 192);
    cin += 320 + 192;
    // InceptionE: expanded filter banks.
    for name in ["Mixed_7b", "Mixed_7c"] {
        n.conv_bn(&format!("{name}.branch1x1"), sq(1), cin, 320);
        n.conv_bn(&format!("{name}.branch3x3_1"), sq(1), cin, 384);
        n.conv_bn(&format!("{name}.branch3x3_2a"), (1, 3), 384, 384);
        n.conv_bn(&format!("{name}.branch3x3_2b"), (3, 1), 384, 384);
        n.conv_bn(&format!("{name}.branch3x3dbl_1"), sq(1), cin, 448);
        n.conv_bn(&format!("{name}.branch3x3dbl_2"), sq(3), 448, 384);
        n.conv_bn(&format!("{name}.branch3x3dbl_3a"), (1, 3), 384, 384);
        n.conv_bn(&format!("{name}.branch3x3dbl_3b"), (3, 1), 384, 384);
        n.conv_bn(&format!("{name}.branch_pool"), sq(1), cin, 192);
        cin = 320 + 2 * 384 + 2 * 384 + 192;
    }
    n.dense("fc", cin, CLASSES);
    n.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernels(v: &[Var], rank: usize) -> usize {
        v.iter()
            .filter(|x| x.name.ends_with("/kernel") && x.shape.len() == rank)
            .count()
    }

    #[test]
    fn resnet50_matches_torchvision() {
        let v = Model::Resnet50.variables();
        assert_eq!(v.len(), 161);
        assert_eq!(kernels(&v, 4), 53);
        assert_eq!(v.iter().filter(|x| x.name.ends_with("/gamma")).count(), 53);
        assert_eq!(params(&v), 25_557_032);
    }

    #[test]
    fn vgg16_matches_torchvision() {
        let v = Model::Vgg16.variables();
        assert_eq!(v.len(), 32);
        assert_eq!(kernels(&v, 4), 13);
        assert_eq!(kernels(&v, 2), 3);
        assert_eq!(params(&v), 138_357_544);
        assert_eq!(v[26].shape, vec![25088, 4096]);
    }

    #[test]
    fn inception3_matches_torchvision_and_keras() {
        let v = Model::Inception3.variables();
        assert_eq!(kernels(&v, 4), 94);
        assert_eq!(v.len(), 284);
        assert_eq!(params(&v), 23_834_568);
        // Keras InceptionV3: no gammas, plus moving mean and variance per channel.
        let channels: usize = v
            .iter()
            .filter(|x| x.name.ends_with("/gamma"))
            .map(Var::numel)
            .sum();
        assert_eq!(params(&v) - channels + 2 * channels, 23_851_784);
        let with_aux = inception3(true);
        assert_eq!(with_aux.len(), 292);
        assert_eq!(params(&with_aux), 27_161_264);
    }

    #[test]
    fn wrn16_4_matches_the_paper() {
        let v = Model::Wrn16x4.variables();
        assert_eq!(v.len(), 44);
        assert_eq!(kernels(&v, 4), 1 + 2 * 6 + 3);
        assert_eq!(params(&v), 2_748_890);
        // "2.7M" (Zagoruyko & Komodakis, table 1).
        assert_eq!((params(&v) as f64 / 1e5).round(), 27.0);
        // The widest layer travels one-sided (>= 256 KiB), the small ones inline.
        let largest = v.iter().map(|x| x.numel() * 4).max().unwrap();
        assert_eq!(largest, 3 * 3 * 256 * 256 * 4);
    }

    #[test]
    fn names_are_unique() {
        for m in [
            Model::Resnet50,
            Model::Vgg16,
            Model::Inception3,
            Model::Wrn16x4,
        ] {
            let v = m.variables();
            let mut names: Vec<&str> = v.iter().map(|x| x.name.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), v.len(), "{}", m.name());
        }
    }
}
