//! Whether this node can serve `direct_gpu` loads over verbs, and if not, why: answered
//! without touching a device, so it is safe to ask on any host.

use super::affinity::unusable_reason;
use super::sysfs::{Sysfs, SysfsError};

/// The answer of the capability gate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VerbsCapability {
    /// These NICs have an active port with a usable address.
    Usable { nics: Vec<String> },
    /// Direct loads over verbs must be refused with this reason.
    Unusable { reason: String },
}

impl VerbsCapability {
    pub fn is_usable(&self) -> bool {
        matches!(self, VerbsCapability::Usable { .. })
    }

    /// The refusal reason, if any.
    pub fn refusal(&self) -> Option<&str> {
        match self {
            VerbsCapability::Usable { .. } => None,
            VerbsCapability::Unusable { reason } => Some(reason),
        }
    }
}

/// Probes sysfs for a usable RDMA device. Without the `verbs` feature the answer is always
/// unusable, naming the feature.
pub fn probe(sysfs: &Sysfs) -> VerbsCapability {
    if !cfg!(feature = "verbs") {
        return VerbsCapability::Unusable {
            reason: "direct GPU loads over verbs need kvferry built with the `verbs` feature"
                .into(),
        };
    }
    probe_devices(sysfs)
}

/// The device half of [`probe`], independent of how the crate was built.
pub fn probe_devices(sysfs: &Sysfs) -> VerbsCapability {
    let nics = match sysfs.nics() {
        Ok(n) => n,
        Err(SysfsError::NoDevice { path }) => {
            return VerbsCapability::Unusable {
                reason: format!("no RDMA device on this node ({} is empty)", path.display()),
            }
        }
        Err(e) => {
            return VerbsCapability::Unusable {
                reason: format!("RDMA devices could not be read: {e}"),
            }
        }
    };
    let mut usable = Vec::new();
    let mut reasons = Vec::new();
    for n in &nics {
        match unusable_reason(n) {
            None => usable.push(n.name.clone()),
            Some(r) => reasons.push(r),
        }
    }
    if usable.is_empty() {
        VerbsCapability::Unusable {
            reason: format!("no usable RDMA port: {}", reasons.join("; ")),
        }
    } else {
        VerbsCapability::Usable { nics: usable }
    }
}
