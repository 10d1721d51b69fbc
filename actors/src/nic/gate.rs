//! The `direct_gpu` gate of a node whose `[[nic]]` config asks for verbs: direct loads over
//! verbs are granted only where every configured verbs NIC is usable and open; otherwise
//! Query refuses them naming why (design rule 5: no silent downgrade). A plain function over
//! the capability probe and what opening the NICs said.

use kvferry_transport::verbs::{is_soft_name, VerbsCapability};

/// Why Query must refuse `direct_gpu`, or `None` when it may grant it. `configured` are the
/// verbs NICs of the config (none: verbs was not asked for, nothing to refuse); `cap` is the
/// capability probe's answer; `open_failures` are `(nic, reason)` of NICs that could not be
/// opened.
pub fn verbs_refusal(
    configured: &[String],
    cap: &VerbsCapability,
    open_failures: &[(String, String)],
) -> Option<String> {
    if configured.is_empty() {
        return None;
    }
    // The software verbs device (`soft_*` names) is in every build and needs no hardware:
    // only whether it opened matters.
    let hardware: Vec<String> = configured
        .iter()
        .filter(|c| !is_soft_name(c))
        .cloned()
        .collect();
    if hardware.is_empty() {
        return open_failures.first().map(|(nic, reason)| {
            format!(
                "direct GPU loads over verbs are unavailable on this node: nic {nic} could \
                 not be opened: {reason}"
            )
        });
    }
    let configured = &hardware[..];
    match cap {
        VerbsCapability::Unusable { reason } => Some(format!(
            "direct GPU loads over verbs are unavailable on this node: {reason}"
        )),
        VerbsCapability::Usable { nics } => {
            if let Some(missing) = configured.iter().find(|c| !nics.contains(c)) {
                return Some(format!(
                    "direct GPU loads over verbs are unavailable on this node: configured nic \
                     {missing} is not a usable RDMA device (usable: [{}])",
                    nics.join(", ")
                ));
            }
            open_failures.first().map(|(nic, reason)| {
                format!(
                    "direct GPU loads over verbs are unavailable on this node: nic {nic} could \
                     not be opened: {reason}"
                )
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_with_the_reason() {
        let names = vec!["mlx5_0".to_string()];
        let none = VerbsCapability::Unusable {
            reason: "no RDMA device on this node (/sys/class/infiniband is empty)".into(),
        };
        assert_eq!(verbs_refusal(&[], &none, &[]), None);
        let r = verbs_refusal(&names, &none, &[]).unwrap();
        assert!(r.contains("no RDMA device on this node"), "{r}");
        let usable = VerbsCapability::Usable {
            nics: vec!["mlx5_0".into(), "mlx5_2".into()],
        };
        assert_eq!(verbs_refusal(&names, &usable, &[]), None);
        let r = verbs_refusal(&["mlx5_1".to_string()], &usable, &[]).unwrap();
        assert!(r.contains("mlx5_1 is not a usable RDMA device"), "{r}");
        let r = verbs_refusal(
            &names,
            &usable,
            &[("mlx5_0".into(), "ibv_open_device failed".into())],
        )
        .unwrap();
        assert!(r.contains("nic mlx5_0 could not be opened"), "{r}");
        // The software device needs no RDMA hardware; a real NIC beside it still does.
        let soft = vec!["soft_mlx5_0".to_string()];
        assert_eq!(verbs_refusal(&soft, &none, &[]), None);
        let both = vec!["soft_mlx5_0".to_string(), "mlx5_0".to_string()];
        assert!(verbs_refusal(&both, &none, &[]).is_some());
        let r = verbs_refusal(&soft, &none, &[("soft_mlx5_0".into(), "boom".into())]).unwrap();
        assert!(r.contains("soft_mlx5_0 could not be opened"), "{r}");
    }
}
