//! Who may use packd, as pure rules over a peer's credentials (`SO_PEERCRED` uid and gid,
//! `SO_PEERGROUPS` supplementary groups): the data plane's allow lists and the control
//! plane's admins. One matching rule ([`Ids::names`]) serves both. No sockets, no gRPC:
//! the planes read the credentials and ask here.
#![forbid(unsafe_code)]

/// Root and packd's own uid: always admitted, always admins.
pub fn privileged(uid: u32) -> bool {
    uid == 0 || uid == nix::unistd::getuid().as_raw()
}

/// The uids and gids a rule names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ids {
    /// uids named.
    pub uids: Vec<u32>,
    /// gids named; a peer belongs by its primary or any supplementary group.
    pub gids: Vec<u32>,
}

impl Ids {
    /// Whether the rule names nobody.
    pub fn is_empty(&self) -> bool {
        self.uids.is_empty() && self.gids.is_empty()
    }

    /// Whether the rule names a peer with `uid`, primary `gid` and the supplementary groups
    /// `groups` returns (asked for only when gids are set and nothing else matched: reading
    /// them is a system call).
    pub fn names<G: AsRef<[u32]>>(&self, uid: u32, gid: u32, groups: impl FnOnce() -> G) -> bool {
        self.uids.contains(&uid)
            || self.gids.contains(&gid)
            || (!self.gids.is_empty() && groups().as_ref().iter().any(|g| self.gids.contains(g)))
    }
}

/// The data plane's allow lists (`allow_uids`, `allow_gids`): a peer is admitted if they
/// name it, or they are empty. Root and packd's own uid are always admitted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DataAllow(pub Ids);

impl DataAllow {
    /// Whether a peer may use the data plane.
    pub fn admits<G: AsRef<[u32]>>(&self, uid: u32, gid: u32, groups: impl FnOnce() -> G) -> bool {
        self.0.is_empty() || privileged(uid) || self.0.names(uid, gid, groups)
    }
}

/// Who may use the control plane's mutating RPCs: root, packd's own uid, the ids of
/// `admin_uids`/`admin_gids`; over TCP (no credentials) nobody unless `tcp_mutations`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    /// Admins besides root and packd's own uid.
    pub admins: Ids,
    /// Whether every TCP caller may use mutating RPCs.
    pub tcp_mutations: bool,
}

impl Policy {
    /// Whether a local peer is an admin.
    pub fn admits_local(&self, uid: u32, gid: u32, groups: &[u32]) -> bool {
        privileged(uid) || self.admins.names(uid, gid, || groups)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_names_by_uid_primary_gid_or_supplementary_group_and_reads_groups_only_when_needed() {
        let ids = Ids { uids: vec![1001], gids: vec![2002] };
        let never = || -> Vec<u32> { panic!("groups read although uid or gid matched") };
        assert!(ids.names(1001, 5, never));
        assert!(ids.names(7, 2002, never));
        assert!(ids.names(7, 5, || vec![4, 2002]));
        assert!(!ids.names(7, 5, || vec![4]));
        let by_uid = Ids { uids: vec![1], gids: vec![] };
        assert!(!by_uid.names(7, 5, never), "no gids: groups are never read");

        let open = DataAllow::default();
        assert!(open.admits(12345, 12345, never), "empty lists admit everyone");
        let closed = DataAllow(ids.clone());
        assert!(closed.admits(0, 0, never), "root is always admitted");
        assert!(!closed.admits(65534, 65534, || vec![1]) || privileged(65534));
        let p = Policy { admins: ids, tcp_mutations: false };
        assert!(p.admits_local(0, 5, &[]) && p.admits_local(7, 5, &[2002]));
        assert!(!p.admits_local(65534, 65534, &[1]) || privileged(65534));
    }
}
