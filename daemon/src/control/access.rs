//! Who may do what on the control plane. Read-only RPCs (GetStats, ListEntries,
//! ListClients, health, reflection) serve every caller who can reach the socket; mutating
//! RPCs (Evict, Pin, Unpin, SetBudget, Prefetch) serve admins only: root, packd's own uid,
//! `admin_uids`, and members (by primary or supplementary group) of `admin_gids`. Callers over TCP carry no
//! credentials: they are never admins, unless `control_tcp_allow_mutations` makes every TCP
//! caller one (with a warning at start).
#![forbid(unsafe_code)]

use std::sync::Arc;

use tonic::transport::server::TcpConnectInfo;

use super::peer::LocalInfo;
pub use crate::access::Policy;
use tonic::{Request, Status};

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A local process on the Unix socket, with its credentials.
    Local {
        /// User id.
        uid: u32,
        /// Primary group id.
        gid: u32,
        /// Supplementary group ids.
        groups: Arc<[u32]>,
    },
    /// A caller over TCP (no credentials).
    Tcp,
    /// A caller whose credentials could not be read.
    Unknown,
}

impl Caller {
    /// The caller of `req`.
    pub fn of<T>(req: &Request<T>) -> Self {
        if let Some(info) = req.extensions().get::<LocalInfo>()
            && let Some(cred) = info.uds.peer_cred
        {
            return Caller::Local { uid: cred.uid(), gid: cred.gid(), groups: Arc::clone(&info.groups) };
        }
        if req.extensions().get::<TcpConnectInfo>().is_some() {
            return Caller::Tcp;
        }
        Caller::Unknown
    }

    /// The uid whose share of the source pool the caller's work takes (packd's own for
    /// callers without credentials).
    pub fn uid(&self) -> u32 {
        match self {
            Caller::Local { uid, .. } => *uid,
            _ => nix::unistd::getuid().as_raw(),
        }
    }
}

/// The control plane's questions to the access [`Policy`], by [`Caller`].
pub trait ControlAccess {
    /// Whether `caller` may use mutating RPCs.
    fn is_admin(&self, caller: &Caller) -> bool;
    /// Refuses `rpc` unless `caller` is an admin.
    fn require_admin(&self, caller: &Caller, rpc: &str) -> Result<(), Status>;
}

impl ControlAccess for Policy {
    fn is_admin(&self, caller: &Caller) -> bool {
        match caller {
            Caller::Local { uid, gid, groups } => self.admits_local(*uid, *gid, groups),
            Caller::Tcp => self.tcp_mutations,
            Caller::Unknown => false,
        }
    }

    fn require_admin(&self, caller: &Caller, rpc: &str) -> Result<(), Status> {
        if self.is_admin(caller) {
            return Ok(());
        }
        let who = match caller {
            Caller::Local { uid, gid, .. } => format!("uid {uid} (gid {gid}) is not an admin"),
            Caller::Tcp => "callers over TCP are not admins (control_tcp_allow_mutations is off)".to_string(),
            Caller::Unknown => "the caller's credentials are unknown".to_string(),
        };
        Err(Status::permission_denied(format!(
            "{rpc} changes packd's state and needs an admin (root, packd's own uid, admin_uids or admin_gids): {who}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admins_are_root_packd_and_the_configured_ids() {
        let admins = crate::access::Ids { uids: vec![1001], gids: vec![2002] };
        let p = Policy { admins, tcp_mutations: false };
        let local = |uid, gid, groups: &[u32]| Caller::Local { uid, gid, groups: groups.into() };
        assert!(p.is_admin(&local(0, 5, &[])));
        assert!(p.is_admin(&local(nix::unistd::getuid().as_raw(), 5, &[])));
        assert!(p.is_admin(&local(1001, 5, &[])));
        assert!(p.is_admin(&local(7, 2002, &[])));
        assert!(p.is_admin(&local(7, 5, &[4, 2002])), "a supplementary group counts");
        let nobody = local(65534, 65534, &[65534, 4]);
        assert!(!p.is_admin(&nobody) || nix::unistd::getuid().as_raw() == 65534);
        assert!(!p.is_admin(&Caller::Tcp) && !p.is_admin(&Caller::Unknown));
        assert!(Policy { tcp_mutations: true, ..p.clone() }.is_admin(&Caller::Tcp));
        let e = p.require_admin(&Caller::Tcp, "Evict").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("control_tcp_allow_mutations"), "{}", e.message());
    }
}
