use std::time::Duration;

use super::*;

#[test]
fn the_redis_sample_documents_the_directory_defaults() {
    let text = include_str!("../../../config/cluster-redis.toml");
    let cfg = NodeConfig::from_toml(text, "cluster-redis.toml").unwrap();
    assert_eq!(cfg.directory, DirectoryConfig::default());
    let o = cfg.directory.redis_options();
    assert_eq!(o.lookup_timeout, Duration::from_millis(100));
    assert_eq!(o.reconcile_interval, Duration::from_secs(30));
    assert_eq!(o, crate::peer::RedisOptions::default());
}

#[test]
fn defaults_validate_and_sizes_parse() {
    NodeConfig::default().validate().unwrap();
    assert_eq!(ByteSize::parse("64MiB").unwrap(), ByteSize(64 << 20));
    assert_eq!(ByteSize::parse("1 GiB").unwrap(), ByteSize(1 << 30));
    assert_eq!(ByteSize::parse("4096").unwrap(), ByteSize(4096));
    assert!(ByteSize::parse("12 parsecs").is_err());
    assert_eq!(ByteSize(3 << 20).to_string(), "3MiB");
}

#[test]
fn sizes_in_binary_and_decimal_units_and_their_limits() {
    let ok = |s: &str| ByteSize::parse(s).unwrap().0;
    assert_eq!(ok("2KiB"), 2048);
    assert_eq!(ok("  8 mib "), 8 << 20);
    assert_eq!(ok("1.5GiB"), 3 << 29);
    assert_eq!(ok("3 TiB"), 3 << 40);
    assert_eq!(ok("64MB"), 64_000_000);
    assert_eq!(ok("2G"), 2_000_000_000);
    assert_eq!(ok("512 B"), 512);
    for bad in ["", "MiB", "-1MiB", "1 parsec", "0x100", "1e3"] {
        let e = ByteSize::parse(bad).unwrap_err();
        assert!(e.contains("not a byte size"), "{bad:?}: {e}");
    }
    // bytesize saturates on overflow; that must be an error here, not u64::MAX.
    let e = ByteSize::parse("99999999999 TiB").unwrap_err();
    assert!(e.contains("larger than"), "{e}");
    assert_eq!(ok("8388607 TiB"), 8388607 << 40);
    // What a config prints reads back as the same size.
    for v in [0, 1, 4095, 4096, 3 << 20, (5 << 30) + 1, ByteSize::MAX] {
        assert_eq!(ok(&ByteSize(v).to_string()), v);
    }
    let cfg = NodeConfig::from_toml("[pool]\nsize = \"-5\"\n", "x.toml");
    assert!(cfg.is_err());
}

#[test]
fn unknown_key_names_line_and_column() {
    let err = NodeConfig::from_toml(
        "node-id = \"a\"\n[pool]\nsize = \"1GiB\"\nslots = 3\n",
        "x.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("slots"), "{err}");
    assert!(err.contains("line 4"), "{err}");
    assert!(err.contains("column 1"), "{err}");
}

#[test]
fn engine_section_defaults_and_unknown_keys() {
    let cfg = NodeConfig::from_toml("[engine]\n", "e.toml").unwrap();
    assert_eq!(cfg.engine, Some(EngineConfig::default()));
    assert!(NodeConfig::from_toml("", "e.toml")
        .unwrap()
        .engine
        .is_none());
    let err = NodeConfig::from_toml("[engine]\nlisen = \"x\"\n", "e.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("lisen") && err.contains("line 2"), "{err}");
}

#[test]
fn the_device_section_names_the_gpu_copy_options() {
    use kvferry_gpu::cuda::{CopyPath, DEFAULT_STAGING_CHUNKS, DEFAULT_STAGING_CHUNK_BYTES};
    let o = NodeConfig::default().device.cuda_options();
    assert_eq!(o.copy_path, CopyPath::Auto);
    assert_eq!(o.staging_chunk_bytes, DEFAULT_STAGING_CHUNK_BYTES);
    assert_eq!(o.staging_chunks, DEFAULT_STAGING_CHUNKS);
    assert_eq!(
        o.completion_spin,
        kvferry_gpu::cuda::DEFAULT_COMPLETION_SPIN
    );
    let cfg = NodeConfig::from_toml(
        "[device]\ncopy-path = \"per-op\"\nstaging-chunk = \"8MiB\"\nstaging-chunks = 4\n\
         completion-spin-us = 0\n",
        "d.toml",
    )
    .unwrap();
    let o = cfg.device.cuda_options();
    assert_eq!(o.copy_path, CopyPath::PerOp);
    assert_eq!((o.staging_chunk_bytes, o.staging_chunks), (8 << 20, 4));
    assert!(o.completion_spin.is_zero());
}

#[test]
fn cross_field_rules_name_the_key() {
    let cases = [
        (
            "[pool]\nsize = \"1MiB\"\nslot-bytes = \"2MiB\"\n",
            "pool.size",
        ),
        ("[pool]\nslot-bytes = 100\n", "pool.slot-bytes"),
        (
            "[lease]\nttl-secs = 10\nsweep-interval-secs = 30\n",
            "lease.sweep-interval-secs",
        ),
        ("[device]\nkind = \"tpu\"\n", "device.kind"),
        ("[device]\ncopy-path = \"dma\"\n", "device.copy-path"),
        ("[device]\nstaging-chunks = 1\n", "device.staging-chunks"),
        (
            "[device]\ncompletion-spin-us = 1000001\n",
            "device.completion-spin-us",
        ),
        (
            "[device]\nstaging-chunk = \"1KiB\"\n",
            "device.staging-chunk",
        ),
        ("[cluster]\nprovider = \"verbs\"\n", "cluster.provider"),
        ("[cluster]\nprovider = \"udp\"\n", "cluster.provider"),
        (
            "[cluster]\npeer-listen = \"nowhere\"\n",
            "cluster.peer-listen",
        ),
        ("[cluster]\ndirectory = \"etcd\"\n", "cluster.directory"),
        ("[cluster]\ndata-lanes = 0\n", "cluster.data-lanes"),
        ("[cluster]\ndata-lanes = 17\n", "cluster.data-lanes"),
        ("[cluster]\ntls-data-lanes = 0\n", "cluster.tls-data-lanes"),
        ("[cluster]\ntls-data-lanes = 17\n", "cluster.tls-data-lanes"),
        ("[engine]\nlisten = \"nowhere\"\n", "engine.listen"),
        ("[engine]\nfd-dir = \"relative\"\n", "engine.fd-dir"),
        ("[engine]\ntoken = \"two words\"\n", "engine.token"),
        (
            "[engine]\nmax-message-bytes = \"2GiB\"\n",
            "engine.max-message-bytes",
        ),
        (
            "[engine]\ncompletion-retention = 0\n",
            "engine.completion-retention",
        ),
        ("[engine]\nhandle-ttl-secs = 0\n", "engine.handle-ttl-secs"),
        (
            "[engine]\nmailbox-spin-us = 1000001\n",
            "engine.mailbox-spin-us",
        ),
        (
            "[directory]\nlookup-timeout-ms = 0\n",
            "directory.lookup-timeout-ms",
        ),
        (
            "[directory]\nbreaker-failures = 0\n",
            "directory.breaker-failures",
        ),
        (
            "[directory]\nreconcile-interval-secs = 0\n",
            "directory.reconcile-interval-secs",
        ),
        ("[directory]\nkey-prefix = \"\"\n", "directory.key-prefix"),
        (
            "[cluster]\n[[cluster.peers]]\nnode-id = \"node-0\"\naddress = \"127.0.0.1:1\"\n",
            "cluster.peers",
        ),
    ];
    for (text, key) in cases {
        let err = NodeConfig::from_toml(text, "t.toml").unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { key: k, .. } if *k == key),
            "{err}"
        );
    }
}

fn invalid_key(text: &str, host: &HostMemory) -> (&'static str, String) {
    let cfg: NodeConfig = toml::from_str(text).unwrap();
    match cfg.validate_on(host).unwrap_err() {
        ConfigError::Invalid { key, reason } => (key, reason),
        e => panic!("{text}: {e}"),
    }
}

/// Issue 15: every value `--check-config` used to pass and the node then failed on
/// (or panicked on) is refused, naming the key and saying why.
#[test]
fn check_config_refuses_what_would_not_start() {
    let host = HostMemory {
        total: Some(64 << 30),
        cgroup: None,
        hugepages_free: Some(0),
    };
    let long_dir = format!("/tmp/{}", "d".repeat(100));
    let peers = "[cluster]\npeer-listen = \"127.0.0.1:7100\"\n";
    let cases = [
        ("[lease]\nttl-secs = 9223372036854775807\n", "lease.ttl-secs", "86400"),
        (
            "[lease]\npeer-pin-ttl-secs = 9223372036854775807\n",
            "lease.peer-pin-ttl-secs",
            "86400",
        ),
        (
            "[engine]\nhandle-ttl-secs = 9223372036854775807\n",
            "engine.handle-ttl-secs",
            "86400",
        ),
        ("[pool]\nsize = 9223372036854775807\n", "pool.size", "physical memory"),
        ("[pool]\nsize = \"1048576TiB\"\n", "pool.size", "physical memory"),
        ("[pool]\nsize = \"65GiB\"\n", "pool.size", "physical memory"),
        (
            "[pool]\nsize = \"8GiB\"\nslot-bytes = \"2GiB\"\n",
            "pool.slot-bytes",
            "at most 1GiB",
        ),
        ("[cluster]\ndirectory = \"redis://\"\n", "cluster.directory", "redis://"),
        ("[cluster]\ndirectory = \"redis://:6379\"\n", "cluster.directory", "redis://"),
        ("[cluster]\ndirectory = \"rediss://h:1\"\n", "cluster.directory", "TLS"),
        (
            "[cluster]\ndirectory = \"redis://h:6379/db\"\n",
            "cluster.directory",
            "Invalid database number",
        ),
        (
            "[cluster]\ndirectory = \"redis://h:65536\"\n",
            "cluster.directory",
            "redis://",
        ),
        ("[cluster]\ntoken = \"two words\"\n", "cluster.token", "without spaces"),
        ("[cluster]\ntoken = \"a\\u0007b\"\n", "cluster.token", "printable"),
        ("[engine]\ntoken = \"a\\tb\"\n", "engine.token", "printable"),
        (
            &format!("[engine]\nfd-dir = \"{long_dir}\"\n"),
            "engine.fd-dir",
            "at most 107",
        ),
        (
            &format!("[cluster]\nprovider = \"shm\"\nshm-dir = \"{long_dir}\"\n"),
            "cluster.shm-dir",
            "at most 107",
        ),
        (
            &format!("{peers}[[cluster.peers]]\nnode-id = \"b\"\naddress = \"127.0.0.1:7100\"\n"),
            "cluster.peers",
            "own cluster.peer-listen",
        ),
        (
            "[cluster]\npeer-listen = \"0.0.0.0:7100\"\n[[cluster.peers]]\nnode-id = \"b\"\n\
             address = \"127.0.0.1:7100\"\n",
            "cluster.peers",
            "own cluster.peer-listen",
        ),
        (
            &format!(
                "{peers}[[cluster.peers]]\nnode-id = \"b\"\naddress = \"127.0.0.1:7101\"\n\
                 [[cluster.peers]]\nnode-id = \"c\"\naddress = \"127.0.0.1:7101\"\n"
            ),
            "cluster.peers",
            "b and c have one address",
        ),
        (
            &format!("{peers}[[cluster.peers]]\nnode-id = \"b\"\naddress = \"127.0.0.1:0\"\n"),
            "cluster.peers",
            "no port",
        ),
        ("node-id = \"a/b\"\n", "node-id", "'/'"),
        (
            "[pool]\nsize = \"64MiB\"\nslot-bytes = \"1MiB\"\nhugepages = true\n",
            "pool.hugepages",
            "needs 32 free 2 MiB hugepages, the system has 0",
        ),
        (
            "[engine]\nlisten = \"127.0.0.1:7200\"\n[cluster]\npeer-listen = \"0.0.0.0:7200\"\n",
            "cluster.peer-listen",
            "also engine.listen",
        ),
        (
            "[metrics]\nlisten = \"127.0.0.1:9100\"\n[cluster]\ndata-listen = \"127.0.0.1:9100\"\n",
            "cluster.data-listen",
            "also metrics.listen",
        ),
        (
            "[[nic]]\nname = \"n0\"\nprovider = \"udp\"\n",
            "nic",
            "key `provider` is invalid: unknown provider \"udp\" (expected loopback, tcp, shm or verbs)",
        ),
    ];
    for (text, key, why) in cases {
        let (k, reason) = invalid_key(text, &host);
        assert_eq!(k, key, "{text}: {reason}");
        assert!(reason.contains(why), "{text}: {reason}");
    }
    // The cgroup limit when it is the tighter one.
    let small = HostMemory {
        total: Some(64 << 30),
        cgroup: Some(1 << 30),
        hugepages_free: Some(32),
    };
    let (k, reason) = invalid_key("[pool]\nsize = \"2GiB\"\n", &small);
    assert_eq!(k, "pool.size");
    assert!(reason.contains("cgroup"), "{reason}");
    // The SSD write backlog's copies count on top of the pool.
    let ssd =
        "[ssd]\nwrite-backlog = \"512MiB\"\n[[ssd.dir]]\npath = \"/d\"\ncapacity = \"1GiB\"\n";
    let (k, reason) = invalid_key(&format!("[pool]\nsize = \"768MiB\"\n{ssd}"), &small);
    assert_eq!(k, "ssd.write-backlog");
    assert!(reason.contains("cgroup"), "{reason}");
    let ok: NodeConfig = toml::from_str(&format!("[pool]\nsize = \"256MiB\"\n{ssd}")).unwrap();
    ok.validate_on(&small).unwrap();
    // Within every limit: accepted.
    let ok: NodeConfig = toml::from_str(
        "[pool]\nsize = \"1GiB\"\n[lease]\nttl-secs = 86400\npeer-pin-ttl-secs = 86400\n\
         [cluster]\ndirectory = \"redis://h:6379/2\"\n",
    )
    .unwrap();
    ok.validate_on(&small).unwrap();
    let ok: NodeConfig = toml::from_str(
        "[pool]\nsize = \"64MiB\"\nslot-bytes = \"1MiB\"\nhugepages = true\n\
         [engine]\nlisten = \"127.0.0.1:0\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n\
         [cluster]\npeer-listen = \"127.0.0.1:7100\"\ndata-listen = \"127.0.0.1:7101\"\n",
    )
    .unwrap();
    ok.validate_on(&small).unwrap();
}

#[test]
fn a_size_of_the_wrong_type_says_what_a_size_is() {
    for text in [
        "[pool]\nsize = true\n",
        "[pool]\nsize = 1.5\n",
        "[pool]\nsize = [1]\n",
    ] {
        let err = NodeConfig::from_toml(text, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("expected a size like \"64MiB\" or a number of bytes"),
            "{err}"
        );
        assert!(err.contains("size") && err.contains("line 2"), "{err}");
        assert!(!err.contains("untagged"), "{err}");
    }
    let err = NodeConfig::from_toml("[pool]\nsize = -1\n", "t.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("negative"), "{err}");
    let cfg = NodeConfig::from_toml("[pool]\nsize = 16777216\n", "t.toml").unwrap();
    assert_eq!(cfg.pool.size, ByteSize(16 << 20));
}

/// The sample configs and the defaults stay inside the limits.
#[test]
fn defaults_are_inside_the_limits() {
    let d = NodeConfig::default();
    assert!(d.lease.ttl_secs <= MAX_TTL_SECS);
    assert!(EngineConfig::default().handle_ttl_secs <= MAX_TTL_SECS);
    assert!(d.pool.slot_bytes.0 <= MAX_SLOT_BYTES);
}

/// Over TLS a link opens more connections than in clear unless told how many: the cipher
/// needs the cores.
#[test]
fn tls_links_open_more_lanes_unless_told() {
    let mut c = ClusterConfig::default();
    assert_eq!(c.lanes(false), DEFAULT_DATA_LANES);
    assert_eq!(c.lanes(true), DEFAULT_DATA_LANES * TLS_LANES_FACTOR);
    c.data_lanes = 7;
    assert_eq!(c.lanes(true), MAX_DATA_LANES, "capped");
    c.data_lanes = MAX_DATA_LANES;
    assert_eq!(c.lanes(true), MAX_DATA_LANES);
    c.tls_data_lanes = Some(1);
    assert_eq!(
        (c.lanes(false), c.lanes(true)),
        (MAX_DATA_LANES, 1),
        "explicit wins"
    );
}

/// A config is printed (a failed test, a log line, `--check-config` on error paths): its
/// tokens and its Redis password must not be.
#[test]
fn debug_hides_tokens_and_the_redis_password() {
    let cfg: NodeConfig = toml::from_str(
        "[engine]\ntoken = \"engine-secret\"\n\
         [cluster]\ntoken = \"cluster-secret\"\n\
         directory = \"redis://kv:redis-secret@h:6379/2\"\n",
    )
    .unwrap();
    for debug in [format!("{cfg:?}"), format!("{cfg:#?}")] {
        for secret in ["engine-secret", "cluster-secret", "redis-secret"] {
            assert!(!debug.contains(secret), "{secret}: {debug}");
        }
        assert!(debug.contains("<redacted>"), "{debug}");
        // Where the directory is stays visible; only its password is masked.
        assert!(debug.contains("redis://kv:***@h:6379/2"), "{debug}");
    }
    // An unset token shows as unset: "not checked" is worth seeing.
    let open = format!(
        "{:?}",
        NodeConfig::from_toml("[engine]\n", "e.toml").unwrap()
    );
    assert!(open.contains("token: \"\""), "{open}");
    assert!(!open.contains("<redacted>"), "{open}");
}

#[test]
fn the_tenants_sample_gives_the_cache_its_quotas() {
    use crate::tier::quota::NsMatch;
    let text = include_str!("../../../config/tenants.toml");
    let cfg = NodeConfig::from_toml(text, "tenants.toml").unwrap();
    assert_eq!(cfg.tenants.metric_namespaces, 32);
    let rules = cfg.tenants.rules();
    assert_eq!(rules.default_ram, Some(256 << 20));
    assert_eq!(
        rules.rules[0].matches,
        NsMatch::Prefix("meta-llama%2FLlama-3.1-8B-Instruct/".into())
    );
    assert_eq!(
        rules.ram_for("meta-llama%2FLlama-3.1-8B-Instruct/bfloat16/x"),
        Some(384 << 20)
    );
    assert_eq!(rules.ram_for("scratch/bfloat16/l2-kv8-hd64-b16"), Some(0));
    assert_eq!(rules.ram_for("qwen/bfloat16/x"), Some(256 << 20));
    assert_eq!(
        rules.ssd_for("meta-llama%2FLlama-3.1-8B-Instruct/bfloat16/x"),
        Some(32 << 30)
    );
    assert_eq!(rules.ssd_for("qwen/bfloat16/x"), Some(8 << 30));
    assert_eq!(
        rules.ssd_for("scratch/bfloat16/l2-kv8-hd64-b16"),
        Some(8 << 30),
        "its rule sets RAM only"
    );
    // An SSD quota past the tier's capacity is refused, naming the key.
    let broken = text.replace("ssd = \"32GiB\"", "ssd = \"1TiB\"");
    let e = NodeConfig::from_toml(&broken, "tenants.toml").unwrap_err();
    assert!(e.to_string().contains("tenants.quota.ssd"), "{e}");
    // Without a [tenants] section: no quota, 32 namespaces named.
    let plain = NodeConfig::from_toml("", "plain.toml").unwrap();
    assert_eq!(plain.tenants, TenantsConfig::default());
    assert_eq!(plain.tenants.rules().ram_for("m/d/f"), None);
}

#[test]
fn bad_tenant_quotas_are_refused_naming_the_key() {
    let host = HostMemory {
        total: Some(64 << 30),
        cgroup: None,
        hugepages_free: Some(0),
    };
    // The default pool: 256 MiB of 1 MiB slots.
    let q = |body: &str| format!("[[tenants.quota]]\n{body}\n");
    let cases = [
        (
            q("prefix = \"m/\"\nram = \"1GiB\""),
            "tenants.quota.ram",
            "larger than the whole pool",
        ),
        (
            q("prefix = \"m/\"\nram = 4096"),
            "tenants.quota.ram",
            "less than one pool slot",
        ),
        (
            "[tenants]\ndefault-ram = \"300MiB\"\n".to_owned(),
            "tenants.default-ram",
            "pool.size = 256MiB",
        ),
        (
            q("prefix = \"m/\"\nnamespace = \"m/d/f\"\nram = 0"),
            "tenants.quota",
            "quota #0 must name exactly one of namespace and prefix",
        ),
        (q("ram = 0"), "tenants.quota", "exactly one"),
        (
            q("prefix = \"\"\nram = 0"),
            "tenants.quota.prefix",
            "1 to 515 printable",
        ),
        (
            q("prefix = \"\\u001b[2Jm\\u0007\"\nram = 0"),
            "tenants.quota.prefix",
            r#""\u{1b}[2Jm\u{7}""#,
        ),
        (
            q("namespace = \"just-a-model\"\nram = 0"),
            "tenants.quota.namespace",
            "model/dtype/fingerprint",
        ),
        (
            format!(
                "{}{}",
                q("prefix = \"m/\"\nram = 0"),
                q("prefix = \"m/\"\nram = \"2MiB\"")
            ),
            "tenants.quota.prefix",
            "quota #1: \"m/\" is named by an earlier quota",
        ),
        (
            "[tenants]\nmetric-namespaces = 5000\n".to_owned(),
            "tenants.metric-namespaces",
            "more than 1024",
        ),
    ];
    for (text, want_key, want) in cases {
        let (key, reason) = invalid_key(&text, &host);
        assert_eq!(key, want_key, "{text}: {reason}");
        assert!(reason.contains(want), "{text}: {reason}");
        assert!(
            !reason.chars().any(|c| c.is_control()),
            "raw control characters: {reason:?}"
        );
    }
    // A quota of 0 and a quota of the whole pool are fine.
    let ok = format!(
        "{}{}",
        q("prefix = \"a/\"\nram = 0"),
        q("prefix = \"b/\"\nram = \"256MiB\"")
    );
    let cfg: NodeConfig = toml::from_str(&ok).unwrap();
    cfg.validate_on(&host).unwrap();
    // Unknown keys in a quota are refused by the parser.
    let e = NodeConfig::from_toml(&q("prefix = \"a/\"\nram = 0\ndisk = \"1GiB\""), "t.toml")
        .unwrap_err();
    assert!(e.to_string().contains("unknown field `disk`"), "{e}");
    // SSD quotas: against the [ssd] tier (here 4 disk slots of 1 MiB and a header).
    let tier = "[ssd]\n[[ssd.dir]]\npath = \"/tmp/kvferry-quota-cfg\"\ncapacity = \"5MiB\"\n";
    for (text, want_key, want) in [
        (
            q("prefix = \"m/\"\nssd = \"1GiB\""),
            "tenants.quota.ssd",
            "no [ssd] tier",
        ),
        (
            format!("{tier}{}", q("prefix = \"m/\"\nssd = \"1GiB\"")),
            "tenants.quota.ssd",
            "larger than the whole SSD tier",
        ),
        (
            format!("{tier}{}", q("prefix = \"m/\"\nssd = \"1MiB\"")),
            "tenants.quota.ssd",
            "less than one disk slot",
        ),
        (
            format!("{tier}[tenants]\ndefault-ssd = \"1TiB\"\n"),
            "tenants.default-ssd",
            "larger than the whole SSD tier",
        ),
        (
            q("prefix = \"m/\""),
            "tenants.quota",
            "quota #0 must set ram, ssd or both",
        ),
    ] {
        let (key, reason) = invalid_key(&text, &host);
        assert_eq!(key, want_key, "{text}: {reason}");
        assert!(reason.contains(want), "{text}: {reason}");
    }
    let ok = format!(
        "{tier}{}{}",
        q("prefix = \"a/\"\nssd = 0"),
        q("prefix = \"b/\"\nram = \"2MiB\"\nssd = \"2MiB\"")
    );
    let cfg: NodeConfig = toml::from_str(&ok).unwrap();
    cfg.validate_on(&host).unwrap();
    let rules = cfg.tenants.rules();
    assert_eq!(
        (rules.ssd_for("a/x/y"), rules.ram_for("a/x/y")),
        (Some(0), None)
    );
    assert_eq!(rules.ssd_for("b/x/y"), Some(2 << 20));
}

/// Issue 29: a listener other hosts can reach, with nothing that authenticates its callers,
/// refuses to start, naming its key; a token, mutual TLS or an explicit lab switch lets it.
#[test]
fn exposed_listeners_without_authentication_are_refused_naming_the_key() {
    let refused = |text: &str, key: &str| {
        let err = NodeConfig::from_toml(text, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("config key {key}:")), "{text}: {err}");
        assert!(err.contains("allow-unauthenticated"), "{err}");
    };
    refused("[engine]\nlisten = \"0.0.0.0:7200\"\n", "engine.listen");
    refused("[engine]\nlisten = \"[::]:7200\"\n", "engine.listen");
    refused("[engine]\nlisten = \"10.1.2.3:7200\"\n", "engine.listen");
    refused(
        "[cluster]\npeer-listen = \"0.0.0.0:7100\"\n",
        "cluster.peer-listen",
    );
    refused(
        "[cluster]\npeer-listen = \"192.0.2.7:7100\"\n",
        "cluster.peer-listen",
    );
    let ok = |text: &str| {
        NodeConfig::from_toml(text, "t.toml").unwrap_or_else(|e| panic!("{text}: {e}"));
    };
    // Loopback (the defaults), a token, or the lab switch.
    ok("[engine]\n[cluster]\n");
    ok("[engine]\nlisten = \"127.0.0.2:7200\"\n[cluster]\npeer-listen = \"[::1]:7100\"\n");
    ok("[engine]\nlisten = \"0.0.0.0:7200\"\ntoken = \"t\"\n");
    ok("[cluster]\npeer-listen = \"0.0.0.0:7100\"\ntoken = \"t\"\n");
    ok("[engine]\nlisten = \"0.0.0.0:7200\"\nallow-unauthenticated = true\n");
    ok("[cluster]\npeer-listen = \"0.0.0.0:7100\"\nallow-unauthenticated = true\n");
}

/// Writes a lab CA and node `a`'s certificate and key; returns the `[tls]` lines naming them.
fn tls_section(dir: &std::path::Path, extra: &str) -> String {
    let ca = crate::tls::tests::TestCa::new(dir, "config test CA");
    let f = ca.node("a", "a", false);
    format!(
        "[tls]\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\n{extra}",
        f.cert.display(),
        f.key.display(),
        f.ca.display()
    )
}

/// Mutual TLS authenticates an exposed listener too: every node-to-node call on the peer
/// listener, and the engine listener where client certificates are required (optional ones
/// leave it open).
#[test]
fn mutual_tls_authenticates_exposed_listeners() {
    let dir = crate::tls::tests::temp_dir("config-mtls");
    let tls = tls_section(&dir, "");
    let peer = format!("node-id = \"z\"\n[cluster]\npeer-listen = \"0.0.0.0:7100\"\n{tls}");
    NodeConfig::from_toml(&peer, "t.toml").unwrap();
    let engine_optional = format!("[engine]\nlisten = \"0.0.0.0:7200\"\n{tls}");
    let err = NodeConfig::from_toml(&engine_optional, "t.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("config key engine.listen:"), "{err}");
    let required = tls_section(&dir.join("r"), "engine-client-cert = \"required\"\n");
    let engine_required = format!("[engine]\nlisten = \"0.0.0.0:7200\"\n{required}");
    NodeConfig::from_toml(&engine_required, "t.toml").unwrap();
    // TLS that leaves the peer listener out authenticates nothing there.
    let engine_only = tls_section(&dir.join("e"), "listeners = [\"engine\"]\n");
    let err = NodeConfig::from_toml(
        &format!("[cluster]\npeer-listen = \"0.0.0.0:7100\"\n{engine_only}"),
        "t.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("config key cluster.peer-listen:"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `[tls]` is checked at start: each file read and parsed, the key matched to the
/// certificate, every other value in range; each refusal names its key.
#[test]
fn the_tls_section_is_checked_naming_the_key() {
    let dir = crate::tls::tests::temp_dir("config-tls");
    let good = tls_section(&dir, "");
    let cfg = NodeConfig::from_toml(&good, "t.toml").unwrap();
    let t = cfg.tls.unwrap();
    assert_eq!(t.listeners, vec![TlsListener::Engine, TlsListener::Peer]);
    assert_eq!(t.engine_client_cert, ClientAuth::Optional);
    let refused = |text: String, key: &str| {
        let err = NodeConfig::from_toml(&text, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{text}: {err}");
    };
    let other = crate::tls::tests::TestCa::new(&dir.join("other"), "other").node("b", "b", false);
    let with = |k: &str, v: &std::path::Path| {
        good.lines()
            .map(|l| {
                if l.starts_with(&format!("{k} =")) {
                    format!("{k} = \"{}\"", v.display())
                } else {
                    l.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    refused(
        with("cert", &dir.join("missing.pem")),
        "config key tls.cert:",
    );
    refused(with("key", &other.key), "config key tls.key:");
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, "garbage").unwrap();
    refused(with("ca", &junk), "config key tls.ca:");
    refused(
        "[tls]\nkey = \"/k\"\nca = \"/c\"\n".into(),
        "config key tls.cert:",
    );
    refused(
        format!("{good}listeners = [\"peer\", \"peer\"]\n"),
        "config key tls.listeners:",
    );
    // The tcp data plane is served over TLS when listed.
    let data = NodeConfig::from_toml(
        &format!("{good}listeners = [\"peer\", \"data\"]\n"),
        "t.toml",
    )
    .unwrap();
    assert!(data.tls_on(TlsListener::Data));
    refused(format!("{good}listeners = [\"smtp\"]\n"), "smtp");
    refused(
        format!("{good}handshake-timeout-ms = 0\n"),
        "config key tls.handshake-timeout-ms:",
    );
    refused(
        format!("{good}reload-poll-secs = 100000\n"),
        "config key tls.reload-poll-secs:",
    );
    refused(format!("{good}engine-client-cert = \"maybe\"\n"), "maybe");
    refused(
        format!("{good}expiry-warn-days = 4000\n"),
        "config key tls.expiry-warn-days:",
    );
    assert_eq!(
        NodeConfig::from_toml(&format!("{good}expiry-warn-days = 0\n"), "t.toml")
            .unwrap()
            .tls
            .unwrap()
            .expiry_warning(),
        std::time::Duration::ZERO
    );
    // A certificate of the right CA and key, but past its notAfter: every peer would refuse
    // it, so the node does not start with it.
    let ca = crate::tls::tests::TestCa::new(&dir.join("expiring"), "expiring");
    let expired = ca.node("a", "expired", true);
    let err = NodeConfig::from_toml(
        &format!(
            "[tls]\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\n",
            expired.cert.display(),
            expired.key.display(),
            expired.ca.display()
        ),
        "t.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("config key tls.cert:") && err.contains("expired"),
        "{err}"
    );
    refused(format!("{good}certs = \"x\"\n"), "certs");
    // With TLS between nodes, a peer's node id must be a name its certificate can carry.
    refused(
        format!("[cluster]\n[[cluster.peers]]\nnode-id = \"b_!x\"\naddress = \"127.0.0.1:7102\"\n{good}"),
        "config key cluster.peers:",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The TLS sample starts as it is (its files read from beside it).
#[test]
fn the_tls_sample_loads_with_its_files_beside_it() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/cluster-tls.toml");
    let cfg = NodeConfig::load(path).unwrap();
    let t = cfg.tls.as_ref().unwrap();
    assert!(
        t.cert.is_absolute() && t.cert.ends_with("tls-lab/a.pem"),
        "{t:?}"
    );
    assert!(cfg.tls_on(TlsListener::Peer) && cfg.tls_on(TlsListener::Engine));
    assert!(t.reload_on_sighup);
    assert_eq!(t.expiry_warn_days, 14);
    let c = cfg.cluster.as_ref().unwrap();
    assert_eq!((c.lanes(false), c.lanes(true)), (2, 6));
    // The same text read from elsewhere finds no files: relative paths are the file's.
    let text = std::fs::read_to_string(path).unwrap();
    let err = NodeConfig::from_toml(&text, "elsewhere.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("config key tls.cert:"), "{err}");
}
