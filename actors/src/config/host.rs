//! What this host can give a pool: its memory, its cgroup's limit, its free hugepages.

/// The memory a host pool must fit in: physical memory and this process's cgroup limit,
/// each where it can be read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostMemory {
    /// `MemTotal` of `/proc/meminfo`.
    pub total: Option<u64>,
    /// `memory.max` of this process's cgroup (v2) or `memory.limit_in_bytes` (v1);
    /// `None` where unlimited.
    pub cgroup: Option<u64>,
    /// `HugePages_Free` of `/proc/meminfo` (2 MiB pages), for `pool.hugepages`.
    pub hugepages_free: Option<u64>,
}

impl HostMemory {
    pub fn read() -> Self {
        let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let field = |name: &str| -> Option<u64> {
            let line = info.lines().find(|l| l.starts_with(name))?;
            line.split_whitespace().nth(1)?.parse().ok()
        };
        Self {
            total: field("MemTotal:").and_then(|kib| kib.checked_mul(1024)),
            cgroup: cgroup_limit(),
            hugepages_free: field("HugePages_Free:"),
        }
    }

    /// The tighter of the two limits, and where it comes from.
    pub(super) fn limit(&self) -> Option<(u64, &'static str)> {
        match (self.total, self.cgroup) {
            (Some(t), Some(c)) if c < t => Some((c, "the cgroup memory limit")),
            (Some(t), _) => Some((t, "physical memory")),
            (None, Some(c)) => Some((c, "the cgroup memory limit")),
            (None, None) => None,
        }
    }
}

/// This process's cgroup memory limit: v2 `memory.max` of its own cgroup (or the root
/// of the namespace), else v1 `memory.limit_in_bytes`.
fn cgroup_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("0::").map(|p| p.trim().to_owned()))
        })
        .map(|p| format!("/sys/fs/cgroup{}/memory.max", p.trim_end_matches('/')));
    let candidates = own
        .into_iter()
        .chain(["/sys/fs/cgroup/memory.max".to_owned()])
        .chain(["/sys/fs/cgroup/memory/memory.limit_in_bytes".to_owned()]);
    for path in candidates {
        if let Ok(t) = std::fs::read_to_string(&path) {
            // "max" (v2) or a huge page-rounded number (v1): no limit.
            return t.trim().parse::<u64>().ok().filter(|&n| n < 1 << 62);
        }
    }
    None
}
