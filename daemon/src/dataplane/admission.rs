//! Connection admission: at most `limits.max_connections` data-plane connections, and at
//! most `limits.max_connections_per_uid` from one uid. A slot is held for the life of the
//! connection and given back when its task ends, however it ends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Counts of open connections.
#[derive(Debug)]
pub struct Admission {
    max: usize,
    max_per_uid: usize,
    open: Mutex<(usize, HashMap<u32, usize>)>,
}

/// One admitted connection; dropping it frees the slot.
#[derive(Debug)]
pub struct Slot {
    admission: Arc<Admission>,
    uid: u32,
}

impl Admission {
    /// Admission with these limits.
    pub fn new(max: usize, max_per_uid: usize) -> Arc<Self> {
        Arc::new(Self { max, max_per_uid, open: Mutex::new((0, HashMap::new())) })
    }

    /// Takes a slot for a connection of `uid`, or says which limit is reached.
    pub fn admit(self: &Arc<Self>, uid: u32) -> Result<Slot, String> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if open.0 >= self.max {
            return Err(format!(
                "packd has {} data-plane connections open, its limit (limits.max_connections); try again later",
                open.0
            ));
        }
        let mine = open.1.get(&uid).copied().unwrap_or(0);
        if mine >= self.max_per_uid {
            return Err(format!(
                "uid {uid} has {mine} data-plane connections open, the per-uid limit \
                 (limits.max_connections_per_uid); share connections or close some"
            ));
        }
        open.0 += 1;
        *open.1.entry(uid).or_insert(0) += 1;
        Ok(Slot { admission: Arc::clone(self), uid })
    }

    /// Connections open now.
    #[cfg(test)]
    pub fn open(&self) -> usize {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).0
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.admission.open.lock().unwrap_or_else(|p| p.into_inner());
        open.0 = open.0.saturating_sub(1);
        if let Some(n) = open.1.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                open.1.remove(&self.uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_global_and_per_uid_and_slots_come_back() {
        let a = Admission::new(3, 2);
        let s1 = a.admit(1).unwrap();
        let _s2 = a.admit(1).unwrap();
        assert!(a.admit(1).unwrap_err().contains("limits.max_connections_per_uid"));
        let _s3 = a.admit(2).unwrap();
        assert!(a.admit(3).unwrap_err().contains("limits.max_connections"));
        drop(s1);
        assert_eq!(a.open(), 2);
        let _s4 = a.admit(1).unwrap();
        assert_eq!(a.open(), 3);
    }
}
