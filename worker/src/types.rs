//! What a variable is: dtype, initializer, optimizer, and their protobuf forms.

use crate::pb;

/// Storage dtype of a variable on the PS. Values and gradients always travel as f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// IEEE half precision (storage only; math is f32).
    F16,
    /// bfloat16 (storage only; math is f32).
    Bf16,
}

impl Dtype {
    /// Bytes per element in storage.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }

    pub(crate) fn to_pb(self) -> pb::Dtype {
        match self {
            Dtype::F32 => pb::Dtype::F32,
            Dtype::F16 => pb::Dtype::F16,
            Dtype::Bf16 => pb::Dtype::Bf16,
        }
    }
}

/// Initial values. Random ones depend only on the seed and each element's index in the
/// whole variable, so partitioning does not change them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All the same value.
    Constant(f32),
    /// Normal(0, std).
    Normal {
        /// Standard deviation.
        std: f32,
        /// Seed.
        seed: u64,
    },
    /// Uniform in ±sqrt(6 / (fan_in + fan_out)); fan_in = dim 0, fan_out = the rest.
    GlorotUniform {
        /// Seed.
        seed: u64,
    },
}

impl Init {
    pub(crate) fn to_pb(self) -> pb::Initializer {
        use pb::initializer::Kind;
        let kind = match self {
            Init::Zeros => Kind::Zeros(pb::Zeros {}),
            Init::Constant(c) => Kind::Constant(c),
            Init::Normal { std, seed } => Kind::Normal(pb::NormalInit { std, seed }),
            Init::GlorotUniform { seed } => Kind::GlorotUniform(pb::GlorotUniformInit { seed }),
        };
        pb::Initializer { kind: Some(kind) }
    }
}

pub use ibex_proto::Optimizer;

/// One model variable as the training program declares it.
#[derive(Debug, Clone, PartialEq)]
pub struct VarSpec {
    /// Unique name.
    pub name: String,
    /// Storage dtype on the PS.
    pub dtype: Dtype,
    /// Shape (row-major); a sparse table is `[rows, dim]`.
    pub shape: Vec<usize>,
    /// Initial values.
    pub init: Init,
    /// Optimizer applied on the PS.
    pub optimizer: Optimizer,
    /// A sparse embedding table (use `lookup_rows` / `push_sparse`).
    pub sparse: bool,
}

impl VarSpec {
    /// Elements in the whole variable.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes in storage.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}
