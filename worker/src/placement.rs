//! Where each variable lives: TensorFlow's GreedyLoadBalancingStrategy (each variable, or
//! each partition of a large one, goes to the PS holding the fewest bytes so far), with
//! variables above [`PARTITION_BYTES`] split along dim 0 into near-equal row ranges.
//!
//! Placement is a pure function of the variable list and its order, so every worker that
//! creates the same list computes the same placement without talking to the others.

use crate::types::VarSpec;

/// Variables larger than this are split along dim 0 into parts of at most about this size.
pub const PARTITION_BYTES: usize = 1 << 20;

/// One piece of a variable on one PS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// Index of the PS holding it.
    pub ps: usize,
    /// Its name on that PS: the variable's name, or `"<name>/part_<i>"` when split.
    pub name: String,
    /// First dim-0 row of the whole variable held here.
    pub row_offset: usize,
    /// Dim-0 rows held here.
    pub rows: usize,
}

/// How one variable is spread over the PS shards.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// The variable.
    pub spec: VarSpec,
    /// Its parts, in dim-0 order; concatenated they are the whole variable.
    pub parts: Vec<Part>,
}

impl Placement {
    /// Elements per dim-0 row.
    pub fn row_len(&self) -> usize {
        self.spec.shape.iter().skip(1).product()
    }

    /// The shape of `part`.
    pub fn part_shape(&self, part: &Part) -> Vec<usize> {
        let mut s = self.spec.shape.clone();
        if let Some(d0) = s.first_mut() {
            *d0 = part.rows;
        }
        s
    }
}

/// Places `vars` in order on `num_ps` shards whose current loads (bytes) are `load`;
/// updates `load`.
pub fn place(vars: &[VarSpec], load: &mut [usize]) -> Vec<Placement> {
    vars.iter()
        .map(|v| {
            let bytes = v.bytes();
            let rows = v.shape.first().copied().unwrap_or(1);
            let n = if v.shape.is_empty() {
                1
            } else {
                bytes.div_ceil(PARTITION_BYTES).clamp(1, rows.max(1))
            };
            let row_bytes = bytes.checked_div(rows).unwrap_or(0);
            let mut parts = Vec::with_capacity(n);
            let mut offset = 0;
            for i in 0..n {
                let r = rows / n + usize::from(i < rows % n);
                let ps = least_loaded(load);
                load[ps] += r * row_bytes;
                let name = if n == 1 {
                    v.name.clone()
                } else {
                    format!("{}/part_{i}", v.name)
                };
                parts.push(Part {
                    ps,
                    name,
                    row_offset: offset,
                    rows: r,
                });
                offset += r;
            }
            Placement {
                spec: v.clone(),
                parts,
            }
        })
        .collect()
}

fn least_loaded(load: &[usize]) -> usize {
    // Ties go to the lowest index, so placement is deterministic.
    load.iter()
        .enumerate()
        .min_by_key(|(i, l)| (**l, *i))
        .map(|(i, _)| i)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{Dtype, Init, Optimizer};

    fn var(name: &str, shape: &[usize]) -> VarSpec {
        VarSpec {
            name: name.into(),
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            init: Init::Zeros,
            optimizer: Optimizer::Sgd { lr: 0.1 },
            sparse: false,
        }
    }

    #[test]
    fn greedy_by_bytes() {
        let mut load = vec![0; 2];
        let p = place(
            &[
                var("a", &[100]),
                var("b", &[10]),
                var("c", &[50]),
                var("d", &[50]),
            ],
            &mut load,
        );
        let ps: Vec<usize> = p.iter().map(|p| p.parts[0].ps).collect();
        assert_eq!(ps, vec![0, 1, 1, 1]);
        assert_eq!(load, vec![400, 440]);
    }

    #[test]
    fn large_variables_split_along_dim0() {
        let mut load = vec![0; 3];
        // 1000 x 600 f32 = 2.4 MB -> 3 parts of 334/333/333 rows.
        let p = place(&[var("emb", &[1000, 600])], &mut load);
        let parts = &p[0].parts;
        assert_eq!(parts.len(), 3);
        assert_eq!(
            parts.iter().map(|p| p.rows).collect::<Vec<_>>(),
            vec![334, 333, 333]
        );
        assert_eq!(
            parts.iter().map(|p| p.row_offset).collect::<Vec<_>>(),
            vec![0, 334, 667]
        );
        assert_eq!(
            parts.iter().map(|p| p.ps).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(parts[1].name, "emb/part_1");
        assert_eq!(p[0].part_shape(&parts[2]), vec![333, 600]);
    }
}
