//! A log-linear latency histogram (about 3 % resolution) that worker processes fill and
//! the parent merges; and the median of a sample.
#![allow(clippy::cast_possible_truncation)] // bucket indices are < 2 000; ranks ≤ the count

/// Sub-buckets per power of two.
const SUB: u64 = 32;

/// Latency counts in log-linear buckets of nanoseconds.
#[derive(Clone, Debug, Default)]
pub struct Hist {
    counts: Vec<u64>,
}

fn bucket(ns: u64) -> usize {
    if ns < SUB {
        return ns as usize;
    }
    let e = 63 - u64::from(ns.leading_zeros());
    let sub = (ns >> (e - 5)) & (SUB - 1);
    ((e - 4) * SUB + sub) as usize
}

/// The upper edge of bucket `b`, in nanoseconds.
fn upper(b: usize) -> u64 {
    let b = b as u64;
    if b < SUB {
        return b;
    }
    let e = b / SUB + 4;
    let sub = b % SUB;
    (SUB + sub + 1) << (e - 5)
}

impl Hist {
    /// Records one latency.
    pub fn record(&mut self, ns: u64) {
        let b = bucket(ns.max(1));
        if self.counts.len() <= b {
            self.counts.resize(b + 1, 0);
        }
        self.counts[b] += 1;
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Adds another histogram's counts.
    pub fn merge(&mut self, other: &Hist) {
        if self.counts.len() < other.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
    }

    /// The `q`-quantile (0..=1) in microseconds (bucket upper edge).
    pub fn quantile_us(&self, q: f64) -> f64 {
        let total = self.count();
        if total == 0 {
            return 0.0;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (b, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return upper(b) as f64 / 1e3;
            }
        }
        0.0
    }

    /// The counts as one text line.
    pub fn encode(&self) -> String {
        self.counts.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
    }

    /// Parses [`Hist::encode`]'s output.
    pub fn decode(text: &str) -> anyhow::Result<Self> {
        let counts = text.split(',').filter(|s| !s.is_empty()).map(str::parse).collect::<Result<_, _>>()?;
        Ok(Self { counts })
    }
}

/// The median of `v` (0 when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_a_bucket() {
        let mut h = Hist::default();
        for us in 1..=1000u64 {
            h.record(us * 1000);
        }
        let p50 = h.quantile_us(0.5);
        assert!((500.0..=500.0 * 1.04).contains(&p50), "{p50}");
        let p99 = h.quantile_us(0.99);
        assert!((990.0..=990.0 * 1.04).contains(&p99), "{p99}");
        let back = Hist::decode(&h.encode()).unwrap();
        assert_eq!(back.count(), 1000);
    }
}
