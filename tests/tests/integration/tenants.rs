//! Tenants on a whole node: two namespaces with equal block hashes never hit each other's
//! blocks, a RAM quota is enforced at admission through the store actor, and the
//! per-namespace metrics show both.

use kvferry_actors::config::{ByteSize, QuotaSection};
use kvferry_actors::tier::cache::CacheError;
use kvferry_actors::{BlockHash, Clock, NodeError, PutBlocks};
use kvferry_gpu::KvShape;
use kvferry_harness::*;
use kvferry_testkit::{DeviceKv, KvKind};

fn put_blocks(instance: &str, shape: &KvShape, ids: std::ops::Range<u64>) -> PutBlocks {
    PutBlocks {
        instance: id(instance),
        rank: 0,
        blocks: ids
            .map(|i| {
                (
                    BlockHash::from_u64(i),
                    kvferry_testkit::rank_part(shape, i, 0),
                )
            })
            .collect(),
    }
}

#[test]
fn equal_hashes_of_two_tenants_never_meet_and_a_quota_caps_one() {
    rt().block_on(async {
        let shape = KvShape::new(2, 1, 2, 1024).unwrap();
        let slot = shape.block_bytes();
        let mut cfg = config(slot, 16);
        cfg.tenants.quota.push(QuotaSection {
            namespace: None,
            prefix: Some("small/".into()),
            ram: Some(ByteSize(2 * slot)),
            ssd: None,
        });
        cfg.tenants.quota.push(QuotaSection {
            namespace: None,
            prefix: Some("off/".into()),
            ram: Some(ByteSize(0)),
            ssd: None,
        });
        let (node, dev) = start(
            cfg,
            Clock::system(),
            None::<std::sync::Arc<kvferry_actors::peer::LocalCluster>>,
        );
        let mut kvs = Vec::new();
        for (instance, model) in [("a", "small"), ("b", "big"), ("c", "off")] {
            let kv = DeviceKv::alloc(
                dev.clone(),
                shape,
                KvKind::Split,
                16,
                shape.segment_bytes(),
                0,
            )
            .unwrap();
            kv.register(&node, instance, model, 0).await.unwrap();
            kvs.push(kv);
        }
        // a's put of 5 blocks keeps its first 2 (its quota) and refuses the rest.
        let r = node
            .put_blocks(put_blocks("a", &shape, 0..5))
            .await
            .unwrap();
        assert_eq!(r.written, 2);
        // b has the same hashes: none of a's blocks is a hit for it.
        let q = query(&node, "b", 0..5, false).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (0, 0));
        assert!(q.lease.is_none());
        let r = node
            .put_blocks(put_blocks("b", &shape, 0..5))
            .await
            .unwrap();
        assert_eq!(r.written, 5);
        // Each finds its own, and b's blocks are b's bytes in b's KV.
        let qa = query(&node, "a", 0..5, false).await;
        assert_eq!(qa.local_blocks, 2);
        node.release(qa.lease.unwrap()).await.unwrap();
        let qb = query(&node, "b", 0..5, false).await;
        assert_eq!(qb.local_blocks, 5);
        load_and_verify(
            &node,
            &kvs[1],
            load_request(qb.lease.unwrap(), "b", 0, &[3, 4, 5, 6, 7]),
            0,
            "b's blocks",
        )
        .await;
        // a saving on churns only its own blocks: b keeps all five.
        node.put_blocks(put_blocks("a", &shape, 10..12))
            .await
            .unwrap();
        let qa = query(&node, "a", 10..12, false).await;
        assert_eq!(qa.local_blocks, 2);
        node.release(qa.lease.unwrap()).await.unwrap();
        assert_eq!(query(&node, "a", 0..2, false).await.local_blocks, 0);
        let qb = query(&node, "b", 0..5, false).await;
        assert_eq!(qb.local_blocks, 5);
        node.release(qb.lease.unwrap()).await.unwrap();
        // A quota of 0: never admitted, a typed error naming the namespace.
        let e = node
            .put_blocks(put_blocks("c", &shape, 0..1))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, NodeError::Cache(CacheError::NotAdmitted { namespace })
                if namespace.as_str().starts_with("off/")),
            "{e}"
        );
        let s = settled(&node).await;
        assert_eq!((s.blocks, s.pinned_blocks, s.leases_live), (7, 0, 0));
        let text = node.metrics_text().await.unwrap();
        let ns_a = format!("small/bf16/{}", shape.fingerprint());
        let ns_b = format!("big/bf16/{}", shape.fingerprint());
        for line in [
            format!(
                "kvferry_namespace_ram_bytes{{namespace=\"{ns_a}\"}} {}\n",
                2 * slot
            ),
            format!(
                "kvferry_namespace_ram_quota_bytes{{namespace=\"{ns_a}\"}} {}\n",
                2 * slot
            ),
            format!("kvferry_namespace_refused_blocks_total{{namespace=\"{ns_a}\"}} 1\n"),
            format!(
                "kvferry_namespace_ram_bytes{{namespace=\"{ns_b}\"}} {}\n",
                5 * slot
            ),
            format!(
                "kvferry_namespace_query_blocks_total{{namespace=\"{ns_b}\",result=\"hit\"}} 10\n"
            ),
            format!(
                "kvferry_namespace_query_blocks_total{{namespace=\"{ns_b}\",result=\"miss\"}} 5\n"
            ),
        ] {
            assert!(text.contains(&line), "{line}{text}");
        }
        // b has no quota: no quota series for it.
        assert!(!text.contains(&format!(
            "kvferry_namespace_ram_quota_bytes{{namespace=\"{ns_b}\"}}"
        )));
    });
}

/// An SSD quota through the store actor and a real SSD tier: blocks RAM evicts are written
/// behind to disk, a namespace at its SSD quota replaces its own oldest disk block (which
/// leaves the node) and never another namespace's, a quota of 0 keeps a namespace off the
/// disk, and the per-namespace SSD metrics show it.
#[test]
fn an_ssd_quota_caps_one_namespace_on_disk_and_spares_the_others() {
    use kvferry_actors::tier::ssd::{format, SsdConfig, SsdDir};
    let dir = std::env::temp_dir().join(format!("kvferry-ssd-quota-it-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    rt().block_on(async {
        let shape = KvShape::new(2, 1, 2, 1024).unwrap();
        let slot = shape.block_bytes();
        let stride = format::slot_stride(slot);
        // RAM of 4 blocks, a disk of 32.
        let mut cfg = config(slot, 4);
        cfg.ssd = Some(SsdConfig {
            dir: vec![SsdDir {
                path: dir.clone(),
                capacity: ByteSize(format::HEADER + 32 * stride),
            }],
            direct_io: false,
            ..Default::default()
        });
        for (prefix, ssd) in [("small/", 2 * stride), ("off/", 0)] {
            cfg.tenants.quota.push(QuotaSection {
                namespace: None,
                prefix: Some(prefix.into()),
                ram: None,
                ssd: Some(ByteSize(ssd)),
            });
        }
        let (node, dev) = start(
            cfg,
            Clock::system(),
            None::<std::sync::Arc<kvferry_actors::peer::LocalCluster>>,
        );
        let mut kvs = Vec::new();
        for (instance, model) in [("a", "small"), ("b", "big"), ("c", "off")] {
            let kv = DeviceKv::alloc(
                dev.clone(),
                shape,
                KvKind::Split,
                16,
                shape.segment_bytes(),
                0,
            )
            .unwrap();
            kv.register(&node, instance, model, 0).await.unwrap();
            kvs.push(kv);
        }
        // a fills RAM; then one block at a time pushes a's blocks to disk, each write done
        // before the next, so which disk block is idle (and so replaceable) is known.
        node.put_blocks(put_blocks("a", &shape, 0..4))
            .await
            .unwrap();
        for i in 100..104 {
            node.put_blocks(put_blocks("b", &shape, i..i + 1))
                .await
                .unwrap();
            node.ssd_sync().await.unwrap();
        }
        // a's last two are on disk, its first two were replaced by them and left the node.
        assert_eq!(query(&node, "a", 0..1, false).await.local_blocks, 0);
        let q = query(&node, "a", 2..4, false).await;
        assert_eq!((q.local_blocks, q.ssd_blocks), (2, 2));
        node.release(q.lease.unwrap()).await.unwrap();
        // b is unlimited: its four evicted blocks all go to disk beside a's two.
        node.put_blocks(put_blocks("b", &shape, 104..108))
            .await
            .unwrap();
        node.ssd_sync().await.unwrap();
        let q = query(&node, "b", 100..108, false).await;
        assert_eq!((q.local_blocks, q.ssd_blocks), (8, 4));
        node.release(q.lease.unwrap()).await.unwrap();
        let q = query(&node, "a", 2..4, false).await;
        assert_eq!(q.local_blocks, 2, "b's writes took free slots, not a's");
        node.release(q.lease.unwrap()).await.unwrap();
        // c's quota of 0: what RAM evicts of it never reaches the disk.
        node.put_blocks(put_blocks("c", &shape, 0..4))
            .await
            .unwrap();
        node.ssd_sync().await.unwrap();
        node.put_blocks(put_blocks("b", &shape, 200..204))
            .await
            .unwrap();
        node.ssd_sync().await.unwrap();
        assert_eq!(query(&node, "c", 0..1, false).await.local_blocks, 0);
        settled(&node).await;
        let text = node.metrics_text().await.unwrap();
        let ns = |m: &str| format!("{m}/bf16/{}", shape.fingerprint());
        for line in [
            format!(
                "kvferry_namespace_ssd_bytes{{namespace=\"{}\"}} {}\n",
                ns("small"),
                2 * stride
            ),
            format!(
                "kvferry_namespace_ssd_quota_bytes{{namespace=\"{}\"}} {}\n",
                ns("small"),
                2 * stride
            ),
            format!(
                "kvferry_namespace_ssd_bytes{{namespace=\"{}\"}} {}\n",
                ns("big"),
                8 * stride
            ),
            format!(
                "kvferry_namespace_ssd_refused_blocks_total{{namespace=\"{}\"}} 4\n",
                ns("off")
            ),
        ] {
            assert!(text.contains(&line), "{line}{text}");
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// Tenants of one model (LoRA adapters, say) named in Query and Save: equal hashes never
/// meet across them or the model's own blocks, each has its own quota (an exact rule on its
/// namespace) and its own metric label, and a bad tenant name is refused with nothing
/// stored.
#[test]
fn tenants_of_one_model_are_namespaces_of_their_own() {
    rt().block_on(async {
        let shape = KvShape::new(2, 1, 2, 1024).unwrap();
        let slot = shape.block_bytes();
        let base = format!("m/bf16/{}", shape.fingerprint());
        let mut cfg = config(slot, 16);
        cfg.tenants.quota.push(QuotaSection {
            namespace: Some(format!("{base}/lora-a")),
            prefix: None,
            ram: Some(ByteSize(2 * slot)),
            ssd: None,
        });
        let (node, dev) = start(
            cfg,
            Clock::system(),
            None::<std::sync::Arc<kvferry_actors::peer::LocalCluster>>,
        );
        let kv = register(&node, &dev, "engine", shape, 0, KvKind::Split, 8, 0).await;
        for (dst, block) in [(0u32, 0u64), (1, 1), (2, 2), (3, 3)] {
            kv.write_block(dst, block, 0).unwrap();
        }
        let save = |tenant: Option<&str>| kvferry_actors::SaveRequest {
            instance: id("engine"),
            rank: 0,
            hashes: hashes(0..4),
            src_blocks: vec![0, 1, 2, 3],
            tenant: tenant.map(str::to_owned),
        };
        // Loads go into another instance of the model, so the saver's KV stays as written.
        let dst = register(&node, &dev, "loader", shape, 0, KvKind::Split, 8, 0).await;
        let query_as = |tenant: Option<&str>| {
            let mut q = query_request("loader", 0..4, false);
            q.tenant = tenant.map(str::to_owned);
            node.query(q)
        };
        // lora-a saves first: its quota keeps two of the four blocks.
        let r = node.save(save(Some("lora-a"))).await.unwrap();
        assert_eq!((r.written, r.not_stored), (2, 2));
        // Neither the model itself nor lora-b sees them, though the hashes are equal.
        for t in [None, Some("lora-b")] {
            let q = query_as(t).await.unwrap();
            assert_eq!(q.local_blocks, 0, "{t:?}");
            assert!(q.lease.is_none());
        }
        // Their own saves are not held to lora-a's quota.
        assert_eq!(node.save(save(Some("lora-b"))).await.unwrap().written, 4);
        assert_eq!(node.save(save(None)).await.unwrap().written, 4);
        for (t, hit) in [(Some("lora-a"), 2), (Some("lora-b"), 4), (None, 4)] {
            let q = query_as(t).await.unwrap();
            assert_eq!(q.local_blocks, hit, "{t:?}");
            assert_eq!(
                q.namespace.as_str(),
                match t {
                    Some(t) => format!("{base}/{t}"),
                    None => base.clone(),
                }
            );
            let lease = q.lease.unwrap();
            let dest: Vec<u32> = (4..4 + hit as u32).collect();
            load_and_verify(
                &node,
                &dst,
                load_request(lease, "loader", 0, &dest),
                0,
                "a tenant's blocks",
            )
            .await;
        }
        // A tenant name with a '/' or a control character: refused, nothing stored.
        for bad in ["a/b", "a\u{1b}b", ""] {
            let e = node.save(save(Some(bad))).await.unwrap_err();
            assert!(matches!(e, NodeError::Model(_)), "{e}");
            let e = query_as(Some(bad)).await.unwrap_err();
            assert!(matches!(e, NodeError::Model(_)), "{e}");
        }
        let s = settled(&node).await;
        assert_eq!((s.blocks, s.pinned_blocks, s.leases_live), (10, 0, 0));
        let text = node.metrics_text().await.unwrap();
        for line in [
            format!(
                "kvferry_namespace_ram_bytes{{namespace=\"{base}/lora-a\"}} {}\n",
                2 * slot
            ),
            format!(
                "kvferry_namespace_ram_quota_bytes{{namespace=\"{base}/lora-a\"}} {}\n",
                2 * slot
            ),
            format!(
                "kvferry_namespace_ram_bytes{{namespace=\"{base}/lora-b\"}} {}\n",
                4 * slot
            ),
            format!(
                "kvferry_namespace_ram_bytes{{namespace=\"{base}\"}} {}\n",
                4 * slot
            ),
        ] {
            assert!(text.contains(&line), "{line}{text}");
        }
    });
}
