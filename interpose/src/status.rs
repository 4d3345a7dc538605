//! What an adapter says about its work: why work went private (counted, bounded), the one
//! JSON form every adapter's status is written in, and the reports packd counts.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use packd_client::{Client, Fallback, Report};
use serde::Serialize;

/// Most distinct reasons kept; later ones are counted under [`OTHER`].
pub const MAX_REASONS: usize = 64;
/// The reason past [`MAX_REASONS`] distinct ones are counted under.
pub const OTHER: &str = "other reasons";

/// Work done privately: how often, by reason in words and by reason as packd counts them
/// (`daemon_away`, `unknown_interface`, ...). Serialised as two maps (`reasons`,
/// `fallbacks`) into the status that holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Reasons {
    /// Why, in words, with counts.
    pub reasons: BTreeMap<String, u64>,
    /// The same by [`Fallback`] name.
    pub fallbacks: BTreeMap<String, u64>,
}

impl Reasons {
    /// Counts one private piece of work; `true` the first time this reason is counted (the
    /// adapter says it on stderr then).
    pub fn count(&mut self, fallback: Fallback, reason: &str) -> bool {
        *self.fallbacks.entry(packd_client::report::fallback_name(fallback)).or_default() += 1;
        let key = if self.reasons.len() < MAX_REASONS || self.reasons.contains_key(reason) { reason } else { OTHER };
        let n = self.reasons.entry(key.to_string()).or_default();
        *n += 1;
        *n == 1 && key != OTHER
    }
}

/// One line of JSON: a status as every adapter writes it (at exit, through its C export,
/// to Python).
pub fn to_json(status: &impl Serialize) -> String {
    serde_json::to_string(status).unwrap_or_else(|e| format!("{{\"error\":{:?}}}", e.to_string()))
}

/// Sends `report` on `client`, or keeps it for the next connection this process makes
/// (packd counts it whenever it is up).
pub fn report(report: &Report, client: Option<&Client>) {
    match client {
        Some(c) => c.report(report),
        None => {
            let _ = packd_client::report_later(report);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Probe {
        name: Option<String>,
        #[serde(flatten)]
        why: Reasons,
    }

    #[test]
    fn a_reason_with_a_tab_a_quote_and_non_ascii_is_written_as_valid_json() {
        let reason = "a\ttab, a \"quote\", a back\\slash, a new\nline, \u{1} and caf\u{e9} \u{1F980}";
        let mut why = Reasons::default();
        assert!(why.count(Fallback::Other, reason));
        assert!(!why.count(Fallback::Other, reason));
        let json = to_json(&Probe { name: Some(reason.into()), why });
        assert!(!json.contains('\t') && !json.contains('\n'), "{json}");
        let back: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(back["name"], reason);
        assert_eq!(back["reasons"][reason], 2);
        assert_eq!(back["fallbacks"]["other"], 2);
    }

    #[test]
    fn reasons_past_the_bound_are_counted_together() {
        let mut why = Reasons::default();
        for i in 0..MAX_REASONS + 10 {
            why.count(Fallback::Other, &format!("reason {i}"));
        }
        assert_eq!(why.reasons.len(), MAX_REASONS + 1);
        assert_eq!(why.reasons[OTHER], 10);
        assert_eq!(why.fallbacks.values().sum::<u64>(), (MAX_REASONS + 10) as u64);
    }
}
