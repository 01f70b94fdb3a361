//! Checkpoints, packed caches and adapters through the safe binding: a
//! checkpoint written by kt, described, loaded into a layer (the same output
//! as loading the weights by hand), read back, cached and reloaded; an adapter
//! written and read back; errors carry kt's status and message.
use kt::{
    arg, ckpt_dtype, ckpt_layout, Arg, AdapterConfig, Bf16, Checkpoint, Engine, EngineOptions, LayerArgs,
    LayerShare, LoadLayerOptions, MoeOptions, Status, TensorMut, TensorRef, WriteOptions,
};

const E: usize = 4;
const K: usize = 2;
const H: usize = 16;
const I: usize = 8;
const T: usize = 3;

fn values(n: usize, mult: usize) -> Vec<Bf16> {
    (0..n).map(|i| Bf16::from_f32(((i * mult + 3) % 11) as f32 / 16.0 - 0.3)).collect()
}

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kt-rust-{}-{}", name, std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn forward(moe: &kt::Moe<'_>) -> Vec<f32> {
    forward_routes(moe, &[0, 1, 2, 3, 3, 0])
}

/// The T tokens through moe, routed by ids [T, K].
fn forward_routes(moe: &kt::Moe<'_>, ids: &[i32]) -> Vec<f32> {
    let x: Vec<f32> = (0..T * H).map(|i| (i % 7) as f32 / 8.0 - 0.4).collect();
    let rw: Vec<f32> = vec![0.75, 0.25, 0.5, 0.5, 0.125, 0.875];
    let mut y = vec![0.0f32; T * H];
    let (xt, it, wt) = (
        TensorRef::new(&x, &[T as i64, H as i64]).unwrap(),
        TensorRef::new(&ids, &[T as i64, K as i64]).unwrap(),
        TensorRef::new(&rw, &[T as i64, K as i64]).unwrap(),
    );
    let mut yt = TensorMut::new(&mut y, &[T as i64, H as i64]).unwrap();
    moe.forward(&xt, &it, &wt, &mut yt).unwrap();
    y
}

#[test]
fn checkpoint_loads_reads_and_caches_a_layer() {
    let (wg, wu, wd) = (values(E * I * H, 5), values(E * I * H, 7), values(E * H * I, 3));
    let (gt, ut, dt) = (
        TensorRef::new(&wg, &[E as i64, I as i64, H as i64]).unwrap(),
        TensorRef::new(&wu, &[E as i64, I as i64, H as i64]).unwrap(),
        TensorRef::new(&wd, &[E as i64, H as i64, I as i64]).unwrap(),
    );
    let weights = [Arg::In(arg::W_GATE, &gt), Arg::In(arg::W_UP, &ut), Arg::In(arg::W_DOWN, &dt)];
    let dir = scratch("ckpt");
    let options = WriteOptions {
        config_json: Some(format!("{{\"model_type\": \"qwen3_moe\", \"num_experts_per_tok\": {}}}", K)),
        ..WriteOptions::default()
    };
    kt::write_experts(&dir, &options, &[LayerArgs { layer: 2, args: &weights }]).unwrap();

    let ck = Checkpoint::open(&dir).unwrap();
    let info = ck.info().unwrap();
    assert_eq!((info.model_type.as_str(), info.layout, info.num_moe_layers, info.top_k),
               ("qwen3_moe", ckpt_layout::PER_EXPERT, 1, K as i64));
    let layers = ck.layers().unwrap();
    assert_eq!(layers.len(), 1);
    let l = &layers[0];
    assert_eq!((l.layer, l.num_experts, l.hidden, l.intermediate, l.has_bias), (2, E as i64, H as i64, I as i64, false));
    assert_eq!((l.format.as_str(), l.weight_dtype.as_str(), l.loadable), ("dense", "BF16", true));
    assert_eq!(l.num_tensors, 3 * E as i64);

    let engine = Engine::new(&EngineOptions { num_threads: 1, ..Default::default() }).unwrap();
    let from_ckpt = engine.moe(&ck.moe_options(2).unwrap().max_tokens(T as i64)).unwrap();
    ck.load_layer(2, &from_ckpt).unwrap();
    let by_hand = engine.moe(&MoeOptions::new(E as i64, K as i64, H as i64, I as i64)).unwrap();
    by_hand.load_weights(&weights).unwrap();
    let want = forward(&by_hand);
    assert_eq!(forward(&from_ckpt), want);

    let mut back = vec![Bf16(0); E * H * I];
    {
        let mut bt = TensorMut::new(&mut back, &[E as i64, H as i64, I as i64]).unwrap();
        ck.read_layer(2, &[Arg::Out(arg::W_DOWN, &mut bt)]).unwrap();
    }
    assert_eq!(back, wd);

    let cache = dir.join("layer-2.ktpack");
    from_ckpt.save_packed(&cache).unwrap();
    let cached = engine.moe(&ck.moe_options(2).unwrap()).unwrap();
    cached.load_packed(&cache, true).unwrap();
    assert_eq!(forward(&cached), want);

    let err = ck.load_layer(5, &cached).unwrap_err();
    assert_eq!(err.status, Status::INVALID_ARGUMENT);
    assert!(err.message.contains("kt_ckpt_load_layer"), "{}", err.message);
    let wrong = engine.moe(&MoeOptions::new(E as i64, K as i64, H as i64, 2 * I as i64)).unwrap();
    assert_eq!(wrong.load_packed(&cache, false).unwrap_err().status, Status::SHAPE);
    drop(ck);
    let missing = Checkpoint::open(dir.join("missing")).err().unwrap();
    assert_eq!(missing.status, Status::IO);
    assert!(missing.message.contains("kt_ckpt_open"), "{}", missing.message);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn adapter_round_trip() {
    let r = 2usize;
    let a: Vec<f32> = (0..E * r * H).map(|i| i as f32 / 64.0).collect();
    let b: Vec<f32> = (0..E * I * r).map(|i| -(i as f32) / 32.0).collect();
    let (at, bt) = (
        TensorRef::new(&a, &[E as i64, r as i64, H as i64]).unwrap(),
        TensorRef::new(&b, &[E as i64, I as i64, r as i64]).unwrap(),
    );
    let dir = scratch("adapter");
    let mut config = AdapterConfig::new(r as i64, 4.0);
    config.targets = kt_sys::KT_PROJ_UP;
    config.layout = ckpt_layout::MIXTRAL;
    config.base_model = Some("tiny".into());
    kt::write_adapter(&dir, &config, &[LayerArgs { layer: 1, args: &[Arg::In(arg::LORA_A_UP, &at), Arg::In(arg::LORA_B_UP, &bt)] }])
        .unwrap();
    let read = kt::read_adapter_config(&dir).unwrap();
    assert_eq!((read.rank, read.alpha, read.targets, read.layout, read.dtype),
               (r as i64, 4.0, kt_sys::KT_PROJ_UP, ckpt_layout::MIXTRAL, ckpt_dtype::F32));
    let mut back = vec![0.0f32; E * I * r];
    {
        let mut t = TensorMut::new(&mut back, &[E as i64, I as i64, r as i64]).unwrap();
        kt::read_adapter(&dir, 1, &[Arg::Out(arg::LORA_B_UP, &mut t)]).unwrap();
    }
    assert_eq!(back, b);
    let mut gate = vec![0.0f32; E * r * H];
    let mut t = TensorMut::new(&mut gate, &[E as i64, r as i64, H as i64]).unwrap();
    let err = kt::read_adapter(&dir, 1, &[Arg::Out(arg::LORA_A_GATE, &mut t)]).unwrap_err();
    assert_eq!(err.status, Status::INVALID_ARGUMENT);
    assert!(err.message.contains("kt_ckpt_adapter_read"), "{}", err.message);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_ranks_share_loads_its_experts_and_slice() {
    // Experts 3 and 1, intermediate rows 2..6: what an expert- and
    // tensor-parallel rank holds, the same as those weights loaded by hand.
    let (wg, wu, wd) = (values(E * I * H, 5), values(E * I * H, 7), values(E * H * I, 3));
    let dir = scratch("share");
    {
        let shape = |a: usize, b: usize| [E as i64, a as i64, b as i64];
        let (gi, ui, di) = (shape(I, H), shape(I, H), shape(H, I));
        let (gt, ut, dt) = (TensorRef::new(&wg, &gi).unwrap(), TensorRef::new(&wu, &ui).unwrap(),
                            TensorRef::new(&wd, &di).unwrap());
        let layer = [Arg::In(arg::W_GATE, &gt), Arg::In(arg::W_UP, &ut), Arg::In(arg::W_DOWN, &dt)];
        kt::write_experts(&dir, &WriteOptions::default(), &[LayerArgs { layer: 0, args: &layer }]).unwrap();
    }
    let ck = Checkpoint::open(&dir).unwrap();
    let (experts, (i0, i1)) = (vec![3i64, 1], (2usize, 6usize));
    let (es, is) = (experts.len(), i1 - i0);
    let engine = Engine::new(&EngineOptions { num_threads: 1, ..Default::default() }).unwrap();
    let options = MoeOptions::new(es as i64, K as i64, H as i64, is as i64);
    let share = engine.moe(&options).unwrap();
    let part = LayerShare { experts: Some(experts.clone()), intermediate: Some((i0 as i64, i1 as i64)), zero_down_bias: false };
    ck.load_share(0, &share, &LoadLayerOptions::default(), &part).unwrap();

    let mut sg = Vec::new();
    let mut su = Vec::new();
    let mut sd = Vec::new();
    for &e in &experts {
        let e = e as usize;
        for r in i0..i1 {
            sg.extend_from_slice(&wg[(e * I + r) * H..(e * I + r + 1) * H]);
            su.extend_from_slice(&wu[(e * I + r) * H..(e * I + r + 1) * H]);
        }
        for r in 0..H {
            sd.extend_from_slice(&wd[(e * H + r) * I + i0..(e * H + r) * I + i1]);
        }
    }
    let (sgt, sut, sdt) = (
        TensorRef::new(&sg, &[es as i64, is as i64, H as i64]).unwrap(),
        TensorRef::new(&su, &[es as i64, is as i64, H as i64]).unwrap(),
        TensorRef::new(&sd, &[es as i64, H as i64, is as i64]).unwrap(),
    );
    let by_hand = engine.moe(&options).unwrap();
    by_hand.load_weights(&[Arg::In(arg::W_GATE, &sgt), Arg::In(arg::W_UP, &sut), Arg::In(arg::W_DOWN, &sdt)]).unwrap();
    let local_ids = [0, 1, 1, -1, -1, 0]; // this rank's two experts
    let want = forward_routes(&by_hand, &local_ids);
    assert!(want.iter().any(|v| *v != 0.0));
    assert_eq!(forward_routes(&share, &local_ids), want);

    // An expert the layer lacks: refused with kt's message, nothing loaded.
    let empty = engine.moe(&options).unwrap();
    let bad = LayerShare { experts: Some(vec![0, E as i64]), ..part.clone() };
    let err = ck.load_share(0, &empty, &LoadLayerOptions::default(), &bad).unwrap_err();
    assert_eq!(err.status, Status::INVALID_ARGUMENT);
    assert!(err.message.contains("experts[1] = 4 is not an expert of the layer [0, 4)"), "{}", err.message);
    let _ = std::fs::remove_dir_all(&dir);
}
