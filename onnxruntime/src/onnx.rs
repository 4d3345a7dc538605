//! What packd reads of an ONNX model: the external data files its tensors name (their
//! `location`), so that a model's identity covers the weights kept beside it. A walk over
//! the protobuf's wire format that knows only the fields that can hold a tensor.

#![forbid(unsafe_code)]

use std::collections::BTreeSet;

/// Why a model's bytes could not be read as an ONNX model.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModelError {
    #[error("the model is not a valid ONNX protobuf (at byte {0})")]
    Malformed(usize),
    #[error("the model nests graphs deeper than {MAX_DEPTH} levels")]
    TooDeep,
}

/// Deepest nesting of messages followed (graphs in attributes in graphs ...).
const MAX_DEPTH: usize = 64;

/// The external data locations the tensors of the ONNX model `bytes` name, each once, in
/// order; empty for a model whose weights are all inside it.
pub fn external_locations(bytes: &[u8]) -> Result<Vec<String>, ModelError> {
    let mut found = BTreeSet::new();
    walk(bytes, 0, Kind::Model, 0, &mut found)?;
    Ok(found.into_iter().collect())
}

/// The messages on the way to a tensor.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Model,
    Graph,
    Node,
    Attribute,
    Function,
    Sparse,
    Tensor,
    Entry,
}

/// The kind of the message in field `field` of a `kind` message, when it can lead to a
/// tensor. ONNX's field numbers (onnx.proto, stable since IR version 3).
fn child(kind: Kind, field: u64) -> Option<Kind> {
    Some(match (kind, field) {
        (Kind::Model, 7) => Kind::Graph,
        (Kind::Model, 25) => Kind::Function,
        (Kind::Graph, 1) | (Kind::Function, 7) => Kind::Node,
        (Kind::Graph, 5) => Kind::Tensor,
        (Kind::Graph, 15) | (Kind::Attribute, 22 | 23) => Kind::Sparse,
        (Kind::Node, 5) => Kind::Attribute,
        (Kind::Attribute, 5 | 10) | (Kind::Sparse, 1 | 2) => Kind::Tensor,
        (Kind::Attribute, 6 | 11) => Kind::Graph,
        (Kind::Tensor, 13) => Kind::Entry,
        _ => return None,
    })
}

fn varint(b: &[u8], at: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at)?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

fn walk(b: &[u8], base: usize, kind: Kind, depth: usize, found: &mut BTreeSet<String>) -> Result<(), ModelError> {
    if depth > MAX_DEPTH {
        return Err(ModelError::TooDeep);
    }
    let (mut key, mut value) = (None, None);
    let mut at = 0;
    while at < b.len() {
        let bad = ModelError::Malformed(base + at);
        let tag = varint(b, &mut at).ok_or_else(|| bad.clone())?;
        let (field, wire) = (tag >> 3, tag & 7);
        match wire {
            0 => {
                varint(b, &mut at).ok_or(bad)?;
            }
            1 => at = at.checked_add(8).filter(|&e| e <= b.len()).ok_or(bad)?,
            5 => at = at.checked_add(4).filter(|&e| e <= b.len()).ok_or(bad)?,
            2 => {
                let len = usize::try_from(varint(b, &mut at).ok_or_else(|| bad.clone())?).map_err(|_| bad.clone())?;
                let end = at.checked_add(len).filter(|&e| e <= b.len()).ok_or(bad)?;
                let body = &b[at..end];
                if kind == Kind::Entry {
                    match field {
                        1 => key = Some(body),
                        2 => value = Some(body),
                        _ => {}
                    }
                } else if let Some(next) = child(kind, field) {
                    walk(body, base + at, next, depth + 1, found)?;
                }
                at = end;
            }
            _ => return Err(bad),
        }
    }
    if let (Some(b"location"), Some(v)) = (key, value) {
        found.insert(String::from_utf8_lossy(v).into_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(n: u64, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut put = |mut v: u64| {
            loop {
                let byte = (v & 0x7f) as u8;
                v >>= 7;
                out.push(if v == 0 { byte } else { byte | 0x80 });
                if v == 0 {
                    break;
                }
            }
        };
        put((n << 3) | 2);
        put(body.len() as u64);
        out.extend_from_slice(body);
        out
    }

    fn tensor(location: &str) -> Vec<u8> {
        let entry = [field(1, b"location"), field(2, location.as_bytes())].concat();
        let other = [field(1, b"offset"), field(2, b"4096")].concat();
        // name (field 8), data_location = EXTERNAL (field 14, varint 1), the entries.
        [field(8, b"w"), vec![14 << 3, 1], field(13, &entry), field(13, &other)].concat()
    }

    #[test]
    fn locations_are_found_in_initializers_attributes_and_subgraphs() {
        let sub = field(5, &tensor("inner.bin"));
        let attr = [field(5, &tensor("attr.bin")), field(6, &sub)].concat();
        let node = field(5, &attr);
        let graph = [field(1, &node), field(5, &tensor("weights.bin")), field(5, &tensor("weights.bin"))].concat();
        let model = [vec![8, 7], field(7, &graph)].concat();
        assert_eq!(external_locations(&model).unwrap(), ["attr.bin", "inner.bin", "weights.bin"]);
    }

    #[test]
    fn a_model_with_inline_weights_names_none_and_garbage_is_refused() {
        let graph = field(5, &[field(8, b"w"), field(9, &[0u8; 64])].concat());
        assert!(external_locations(&field(7, &graph)).unwrap().is_empty());
        assert_eq!(external_locations(&[0x3a, 0x40, 1]), Err(ModelError::Malformed(0)));
        assert!(matches!(external_locations(&[0x0f]), Err(ModelError::Malformed(_))));
        let mut graph = field(5, &tensor("x"));
        for _ in 0..30 {
            graph = field(1, &field(5, &field(6, &graph)));
        }
        assert_eq!(external_locations(&field(7, &graph)), Err(ModelError::TooDeep));
    }
}
