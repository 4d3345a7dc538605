//! Plans: ordered `GLOB=LAYOUT` rules that choose each tensor's layout, first match wins.
//!
//! After the user's rules come the defaults: names containing `embed` → `identity`
//! (embedding tables are read by row); a 2-D float `X.weight` → the plan's GEMM layout,
//! with `X.bias` folded into its entry; everything else → `identity`.

use std::collections::HashMap;

use globset::{Glob, GlobMatcher};

use super::layout::{Layout, LayoutError};
use crate::source::{Dtype, TensorInfo};

/// The default GEMM layout.
pub const DEFAULT_LAYOUT: &str = "f32-gemm:nr=16,kr=1,sr=1";

/// Errors of building or applying a plan.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A rule is not `GLOB=LAYOUT`.
    #[error("rule {0:?} is not GLOB=LAYOUT")]
    RuleSyntax(String),
    /// A rule's glob does not parse.
    #[error("rule {rule:?}: bad glob: {}", error.kind())]
    Glob {
        /// The rule.
        rule: String,
        /// The glob error.
        error: globset::Error,
    },
    /// A layout spec is wrong.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A tensor cannot take the layout a rule gave it.
    #[error("tensor {tensor}: {misfit}")]
    Tensor {
        /// The tensor's name.
        tensor: String,
        /// Why it does not fit.
        misfit: Misfit,
    },
}

/// Why a tensor cannot take a GEMM layout.
#[derive(Debug, thiserror::Error)]
pub enum Misfit {
    #[error("{layout} needs a 2-D [N, K] weight, the shape is {shape:?}")]
    NotTwoD { layout: Layout, shape: Vec<u64> },
    #[error("{layout} takes F32, F16 or BF16 sources, not {dtype} (use a rule NAME=identity)")]
    Source { layout: Layout, dtype: Dtype },
    #[error("bias {bias} is {dtype} {shape:?}, expected {want} [{n}]")]
    Bias { bias: String, dtype: Dtype, shape: Vec<u64>, want: Dtype, n: u64 },
}

#[derive(Debug)]
struct Rule {
    glob: String,
    matcher: GlobMatcher,
    layout: Layout,
}

/// A validated plan.
#[derive(Debug)]
pub struct Plan {
    rules: Vec<Rule>,
    gemm: Layout,
}

/// What the plan decided for one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// Index of the tensor in the header's tensor list.
    pub tensor: usize,
    /// Layout to pack it with.
    pub layout: Layout,
    /// Index of the bias tensor folded into this GEMM entry.
    pub bias: Option<usize>,
}

impl Plan {
    /// Builds a plan from user rules (`GLOB=LAYOUT`, tried first, in order) and the layout
    /// for the default GEMM rule (empty: [`DEFAULT_LAYOUT`]).
    pub fn new(rules: &[String], layout: &str) -> Result<Self, PlanError> {
        let layout = if layout.trim().is_empty() { DEFAULT_LAYOUT } else { layout };
        let gemm: Layout = layout.parse()?;
        let rules = rules
            .iter()
            .map(|r| {
                // Globs cannot contain '='; layout specs can ("f32-gemm:nr=8").
                let (glob, spec) = r.split_once('=').ok_or_else(|| PlanError::RuleSyntax(r.clone()))?;
                if glob.trim().is_empty() {
                    return Err(PlanError::RuleSyntax(r.clone()));
                }
                let layout: Layout = spec.parse()?;
                let matcher = Glob::new(glob.trim())
                    .map_err(|error| PlanError::Glob { rule: r.clone(), error })?
                    .compile_matcher();
                Ok(Rule { glob: glob.trim().to_string(), matcher, layout })
            })
            .collect::<Result<_, PlanError>>()?;
        Ok(Self { rules, gemm })
    }

    /// The canonical text of the plan; equal plans have equal text. Part of segment keys.
    pub fn canonical(&self) -> String {
        let mut s = String::new();
        for r in &self.rules {
            s.push_str(&format!("{}={};", r.glob, r.layout));
        }
        s.push_str(&format!("default={}", self.gemm));
        s
    }

    /// Chooses a layout for every tensor. Folded biases get no entry of their own, whatever
    /// rule names them (folding wins).
    pub fn assign(&self, tensors: &[TensorInfo]) -> Result<Vec<Assignment>, PlanError> {
        let by_name: HashMap<&str, usize> = tensors.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
        let layouts: Vec<Layout> = tensors
            .iter()
            .map(|t| {
                let explicit = self.rules.iter().find(|r| r.matcher.is_match(&t.name)).map(|r| r.layout);
                explicit.unwrap_or_else(|| {
                    let gemm_candidate = t.name.ends_with(".weight")
                        && t.shape.len() == 2
                        && t.dtype.is_gemm_float()
                        && !t.name.contains("embed");
                    if gemm_candidate { self.gemm } else { Layout::Identity }
                })
            })
            .collect();
        // First the biases that fold into a GEMM weight: their own rules do not apply.
        let bias_of = |i: usize| -> Option<usize> {
            let prefix = tensors[i].name.strip_suffix(".weight")?;
            by_name.get(format!("{prefix}.bias").as_str()).copied()
        };
        let mut folded = vec![false; tensors.len()];
        for (i, layout) in layouts.iter().enumerate() {
            if let Some(b) = bias_of(i).filter(|_| layout.is_gemm()) {
                folded[b] = true;
            }
        }
        let mut out = Vec::with_capacity(tensors.len());
        for (i, (t, &layout)) in tensors.iter().zip(&layouts).enumerate() {
            if folded[i] {
                continue;
            }
            let mut bias = None;
            if layout.is_gemm() {
                let err = |misfit| PlanError::Tensor { tensor: t.name.clone(), misfit };
                if t.shape.len() != 2 {
                    return Err(err(Misfit::NotTwoD { layout, shape: t.shape.clone() }));
                }
                if !layout.accepts(t.dtype) {
                    return Err(err(Misfit::Source { layout, dtype: t.dtype }));
                }
                if let Some(b) = bias_of(i) {
                    let bt = &tensors[b];
                    if bt.shape != [t.shape[0]] || bt.dtype != t.dtype {
                        let (bias, shape, n) = (bt.name.clone(), bt.shape.clone(), t.shape[0]);
                        return Err(err(Misfit::Bias { bias, dtype: bt.dtype, shape, want: t.dtype, n }));
                    }
                    bias = Some(b);
                }
            }
            out.push(Assignment { tensor: i, layout, bias });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Dtype;

    fn t(name: &str, dtype: Dtype, shape: &[u64]) -> TensorInfo {
        TensorInfo { name: name.into(), dtype, shape: shape.to_vec(), start: 0, len: 0 }
    }

    fn names(plan: &Plan, ts: &[TensorInfo]) -> Vec<(String, String, Option<String>)> {
        plan.assign(ts)
            .unwrap()
            .into_iter()
            .map(|a| (ts[a.tensor].name.clone(), a.layout.to_string(), a.bias.map(|b| ts[b].name.clone())))
            .collect()
    }

    fn model() -> Vec<TensorInfo> {
        vec![
            t("embeddings.word_embeddings.weight", Dtype::F32, &[100, 8]),
            t("embeddings.position_ids", Dtype::I64, &[1, 16]),
            t("l.dense.bias", Dtype::F32, &[4]),
            t("l.dense.weight", Dtype::F32, &[4, 8]),
            t("l.norm.weight", Dtype::F32, &[8]),
        ]
    }

    #[test]
    fn default_rules() {
        let p = Plan::new(&[], "").unwrap();
        let gemm = DEFAULT_LAYOUT.to_string();
        assert_eq!(
            names(&p, &model()),
            vec![
                ("embeddings.word_embeddings.weight".into(), "identity".into(), None),
                ("embeddings.position_ids".into(), "identity".into(), None),
                ("l.dense.weight".into(), gemm, Some("l.dense.bias".into())),
                ("l.norm.weight".into(), "identity".into(), None),
            ]
        );
    }

    #[test]
    fn identity_layout_keeps_every_tensor() {
        let p = Plan::new(&[], "identity").unwrap();
        assert_eq!(names(&p, &model()).len(), 5);
        assert!(names(&p, &model()).iter().all(|(_, l, b)| l == "identity" && b.is_none()));
    }

    #[test]
    fn user_rules_come_first() {
        let p =
            Plan::new(&["l.dense.*=identity".into(), "*word_embeddings*=f32-gemm:nr=8,kr=1,sr=1".into()], "").unwrap();
        let n = names(&p, &model());
        assert_eq!(n[0].1, "f32-gemm:nr=8,kr=1,sr=1");
        assert!(n.iter().any(|(name, l, _)| name == "l.dense.weight" && l == "identity"));
        assert!(n.iter().any(|(name, _, _)| name == "l.dense.bias"));
        assert_eq!(
            p.canonical(),
            "l.dense.*=identity;*word_embeddings*=f32-gemm:nr=8,kr=1,sr=1;default=f32-gemm:nr=16,kr=1,sr=1"
        );
    }

    #[test]
    fn a_folded_bias_ignores_the_rules_that_name_it() {
        // A GEMM rule on a folded bias (1-D) is no error, an identity rule no entry: folding
        // wins, before or after its weight in the source order.
        for bias_rule in ["l.dense.bias=qc8w-gemm", "l.dense.bias=f32-gemm", "l.dense.bias=identity"] {
            let p = Plan::new(&[bias_rule.into()], "").unwrap();
            assert_eq!(names(&p, &model()), names(&Plan::new(&[], "").unwrap(), &model()), "{bias_rule}");
            let mut reversed = model();
            reversed.reverse();
            let n = names(&p, &reversed);
            assert!(n.iter().all(|(name, _, _)| name != "l.dense.bias"), "{bias_rule}: {n:?}");
            assert!(n.iter().any(|(name, _, b)| name == "l.dense.weight" && b.as_deref() == Some("l.dense.bias")));
        }
        // A bias whose weight is not in a GEMM layout is a tensor like any other.
        let p = Plan::new(&["l.dense.weight=identity".into(), "l.dense.bias=f32-gemm".into()], "").unwrap();
        assert!(p.assign(&model()).unwrap_err().to_string().contains("l.dense.bias"));
    }

    #[test]
    fn errors_name_the_tensor() {
        let p = Plan::new(&["*position_ids=f32-gemm".into()], "").unwrap();
        let e = p.assign(&model()).unwrap_err().to_string();
        assert!(e.contains("embeddings.position_ids") && e.contains("I64"), "{e}");
        let p = Plan::new(&["l.norm.weight=f32-gemm".into()], "").unwrap();
        assert!(p.assign(&model()).unwrap_err().to_string().contains("2-D"));
        assert!(Plan::new(&["nolayout".into()], "").is_err());
        assert!(Plan::new(&["x=q9".into()], "").unwrap_err().to_string().contains("unknown layout"));
        assert!(Plan::new(&[], "f32-gemm:nr=5").is_err());
        let ints = vec![t("a.weight", Dtype::I32, &[2, 2])];
        let e = Plan::new(&["a.*=bf16-gemm".into()], "").unwrap().assign(&ints).unwrap_err().to_string();
        assert!(e.contains("a.weight") && e.contains("I32"), "{e}");
        // F16 and BF16 sources take every GEMM layout.
        let halves = vec![t("a.weight", Dtype::F16, &[2, 2]), t("b.weight", Dtype::Bf16, &[2, 2])];
        let a = Plan::new(&[], "qc8w-gemm").unwrap().assign(&halves).unwrap();
        assert!(a.iter().all(|a| a.layout.to_string() == "qc8w-gemm:nr=16,kr=1,sr=1"));
    }
}
