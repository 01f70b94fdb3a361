//! Forward and backward of a small synthetic layer through the safe binding,
//! against a float64 reference computed here. The values are exact in bf16
//! (kt stores weights as bf16), so the reference multiplies the same numbers.
use kt::{arg, Arg, BackwardOptions, Bf16, Engine, EngineOptions, MoeOptions, Status, TensorMut, TensorRef};

const E: usize = 4;
const K: usize = 2;
const H: usize = 16;
const I: usize = 8;
const T: usize = 5;

fn pattern(index: usize, mult: usize, modulus: usize, scale: f32) -> f32 {
    ((index * mult + 7) % modulus) as f32 * scale - (modulus / 2) as f32 * scale
}

struct Layer {
    wg: Vec<f32>, // [E,I,H]
    wu: Vec<f32>, // [E,I,H]
    wd: Vec<f32>, // [E,H,I]
    x: Vec<f32>,  // [T,H]
    dy: Vec<f32>, // [T,H]
    rw: Vec<f32>, // [T,K]
    ids: Vec<i32>, // [T,K]; -1 = no route
}

fn layer() -> Layer {
    let mut l = Layer {
        wg: (0..E * I * H).map(|n| pattern(n, 37, 17, 1.0 / 32.0)).collect(),
        wu: (0..E * I * H).map(|n| pattern(n, 29, 13, 1.0 / 32.0)).collect(),
        wd: vec![0.0; E * H * I],
        x: (0..T * H).map(|n| pattern(n, 13, 11, 0.25)).collect(),
        dy: (0..T * H).map(|n| pattern(n, 7, 9, 0.125)).collect(),
        rw: (0..T * K).map(|n| if n % 2 == 0 { 0.625 } else { 0.375 }).collect(),
        ids: vec![0, 1, 2, 3, 1, -1, 3, 0, 2, 1],
    };
    for e in 0..E {
        for i in 0..I {
            for h in 0..H {
                l.wd[(e * H + h) * I + i] = pattern((e * I + i) * H + h, 23, 19, 1.0 / 32.0);
            }
        }
    }
    l
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// y, dx and d(route weights) in float64, straight from the math.
fn reference(l: &Layer) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut y, mut dx, mut drw) = (vec![0.0; T * H], vec![0.0; T * H], vec![0.0; T * K]);
    for t in 0..T {
        for j in 0..K {
            let e = l.ids[t * K + j];
            if e < 0 {
                continue;
            }
            let e = e as usize;
            let w = l.rw[t * K + j] as f64;
            let wg = |i: usize, h: usize| l.wg[(e * I + i) * H + h] as f64;
            let wu = |i: usize, h: usize| l.wu[(e * I + i) * H + h] as f64;
            let wd = |h: usize, i: usize| l.wd[(e * H + h) * I + i] as f64;
            let x = |h: usize| l.x[t * H + h] as f64;
            let dy = |h: usize| l.dy[t * H + h] as f64;
            let g: Vec<f64> = (0..I).map(|i| (0..H).map(|h| wg(i, h) * x(h)).sum()).collect();
            let u: Vec<f64> = (0..I).map(|i| (0..H).map(|h| wu(i, h) * x(h)).sum()).collect();
            for h in 0..H {
                let o: f64 = (0..I).map(|i| wd(h, i) * silu(g[i]) * u[i]).sum();
                y[t * H + h] += w * o;
                drw[t * K + j] += dy(h) * o;
            }
            for i in 0..I {
                let da = w * (0..H).map(|h| wd(h, i) * dy(h)).sum::<f64>();
                let s = 1.0 / (1.0 + (-g[i]).exp());
                let dg = da * u[i] * s * (1.0 + g[i] * (1.0 - s));
                let du = da * silu(g[i]);
                for h in 0..H {
                    dx[t * H + h] += wg(i, h) * dg + wu(i, h) * du;
                }
            }
        }
    }
    (y, dx, drw)
}

/// Error relative to the reference's largest magnitude; the bf16 activation
/// between the two GEMMs bounds it near 2^-8.
fn assert_close(name: &str, got: &[f32], want: &[f64]) {
    let max_ref = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let max_err = got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((*g as f64 - w).abs()));
    println!("{}: max error {:.3e}, max |ref| {:.3e}", name, max_err, max_ref);
    assert!(max_ref > 0.0 && max_err <= 1e-2 * max_ref, "{}: max error {} against max |ref| {}", name, max_err, max_ref);
}

fn engine() -> Engine {
    Engine::new(&EngineOptions { num_threads: 2, pin_threads: Some(false), verbosity: Some(0), ..Default::default() })
        .unwrap()
}

fn load(moe: &kt::Moe<'_>, l: &Layer) {
    let wg = TensorRef::new(&l.wg, &[E as i64, I as i64, H as i64]).unwrap();
    let wu = TensorRef::new(&l.wu, &[E as i64, I as i64, H as i64]).unwrap();
    let wd = TensorRef::new(&l.wd, &[E as i64, H as i64, I as i64]).unwrap();
    moe.load_weights(&[Arg::In(arg::W_GATE, &wg), Arg::In(arg::W_UP, &wu), Arg::In(arg::W_DOWN, &wd)]).unwrap();
    assert_eq!(moe.num_loaded().unwrap(), E as i64);
}

#[test]
fn fp32_precision_is_an_engine_setting() {
    let default = engine();
    assert!(!default.fp32_precision().unwrap());
    let exact = Engine::new(&EngineOptions { num_threads: 1, fp32_precision: true, ..Default::default() }).unwrap();
    assert!(exact.fp32_precision().unwrap());
    // fp32 operands: the kernels are the fp32-FMA ones (avx2, or ref without AVX2).
    let name = exact.kernel_name().unwrap();
    assert!(name.contains("_f32_f32_"), "{}", name);
}

#[test]
fn numa_option_reports_nodes_and_keeps_the_bits() {
    let l = layer();
    let mut outs = Vec::new();
    for numa in [false, true] {
        let engine = Engine::new(&EngineOptions { num_threads: 2, numa, ..Default::default() }).unwrap();
        let workers = engine.numa_node_workers().unwrap();
        assert_eq!(workers.iter().sum::<i32>(), 2, "{:?}", workers);
        assert!(!workers.is_empty() && (numa || workers.len() == 1), "{:?}", workers);
        let moe = engine.moe(&MoeOptions::new(E as i64, K as i64, H as i64, I as i64).max_tokens(64)).unwrap();
        load(&moe, &l);
        let mut y = vec![0f32; T * H];
        let (t, h, k) = (T as i64, H as i64, K as i64);
        moe.forward(
            &TensorRef::new(&l.x, &[t, h]).unwrap(),
            &TensorRef::new(&l.ids, &[t, k]).unwrap(),
            &TensorRef::new(&l.rw, &[t, k]).unwrap(),
            &mut TensorMut::new(&mut y, &[t, h]).unwrap(),
        )
        .unwrap();
        outs.push(y.iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
    }
    assert_eq!(outs[0], outs[1], "NUMA on changed the bits");
}

#[test]
fn abi_and_version() {
    assert_eq!(kt::library_abi_version(), kt::ABI_VERSION);
    assert!(!kt::version().is_empty());
    println!("kt {}: {}", kt::version(), kt::build_info());
}

#[test]
fn forward_backward_match_reference() {
    let l = layer();
    let engine = engine();
    assert_eq!(engine.num_threads().unwrap(), 2);
    let moe = engine.moe(&MoeOptions::new(E as i64, K as i64, H as i64, I as i64).max_tokens(64)).unwrap();
    load(&moe, &l);

    let (t, h, k) = (T as i64, H as i64, K as i64);
    let x = TensorRef::new(&l.x, &[t, h]).unwrap();
    let ids = TensorRef::new(&l.ids, &[t, k]).unwrap();
    let rw = TensorRef::new(&l.rw, &[t, k]).unwrap();
    let dy = TensorRef::new(&l.dy, &[t, h]).unwrap();
    let (mut y, mut dx, mut drw) = (vec![0f32; T * H], vec![0f32; T * H], vec![0f32; T * K]);

    let mut ctx = {
        let mut y_view = TensorMut::new(&mut y, &[t, h]).unwrap();
        moe.forward_train(&x, &ids, &rw, &mut y_view).unwrap()
    };
    {
        let mut dx_view = TensorMut::new(&mut dx, &[t, h]).unwrap();
        let mut drw_view = TensorMut::new(&mut drw, &[t, k]).unwrap();
        moe.backward(
            &mut ctx,
            &BackwardOptions::default(),
            &[Arg::In(arg::DY, &dy), Arg::Out(arg::DX, &mut dx_view), Arg::Out(arg::DROUTE_WEIGHTS, &mut drw_view)],
        )
        .unwrap();
    }
    let (want_y, want_dx, want_drw) = reference(&l);
    assert_close("y", &y, &want_y);
    assert_close("dx", &dx, &want_dx);
    assert_close("d(route weights)", &drw, &want_drw);
    assert_eq!(drw[2 * K + 1], 0.0, "the unrouted slot got a routing gradient");

    // The context is spent: a second backward is refused with kt's message.
    let err = moe.backward(&mut ctx, &BackwardOptions::default(), &[Arg::In(arg::DY, &dy)]).unwrap_err();
    assert_eq!(err.status, Status::CONTEXT);
    assert!(!err.message.is_empty());
    drop(ctx);

    // bf16 activations in and out give the same y within bf16 rounding.
    let xb: Vec<Bf16> = l.x.iter().map(|v| Bf16::from_f32(*v)).collect();
    let mut yb = vec![Bf16::default(); T * H];
    {
        let xb_view = TensorRef::new(&xb, &[t, h]).unwrap();
        let mut yb_view = TensorMut::new(&mut yb, &[t, h]).unwrap();
        moe.forward(&xb_view, &ids, &rw, &mut yb_view).unwrap();
    }
    let yb: Vec<f32> = yb.iter().map(|v| v.to_f32()).collect();
    assert_close("y (bf16)", &yb, &want_y);
}

#[test]
fn errors_carry_kt_message() {
    let l = layer();
    let engine = engine();
    let moe = engine.moe(&MoeOptions::new(E as i64, K as i64, H as i64, I as i64).max_tokens(64)).unwrap();
    let (t, h, k) = (T as i64, H as i64, K as i64);
    let x = TensorRef::new(&l.x, &[t, h]).unwrap();
    let ids = TensorRef::new(&l.ids, &[t, k]).unwrap();
    let rw = TensorRef::new(&l.rw, &[t, k]).unwrap();
    let mut y = vec![0f32; T * H];

    // No weights yet: the routed experts are not loaded.
    let err = moe.forward(&x, &ids, &rw, &mut TensorMut::new(&mut y, &[t, h]).unwrap()).unwrap_err();
    assert_eq!(err.status, Status::NOT_LOADED, "{}", err);
    println!("kt says: {}", err);

    load(&moe, &l);
    // Y of the wrong width: kt names the argument and both shapes.
    let mut wide = vec![0f32; T * (H + 1)];
    let err = moe.forward(&x, &ids, &rw, &mut TensorMut::new(&mut wide, &[t, h + 1]).unwrap()).unwrap_err();
    assert_eq!(err.status, Status::SHAPE);
    assert!(err.message.contains("KT_ARG_Y"), "{}", err.message);
    assert_eq!(err.status.name(), "KT_ERR_SHAPE");

    // A shape that does not fit the slice never reaches kt.
    assert_eq!(TensorRef::new(&l.x, &[t, h + 1]).err().unwrap().status, Status::SHAPE);

    // Invalid options are refused at creation.
    let err = engine.moe(&MoeOptions::new(0, 1, 4, 4)).err().unwrap();
    assert_eq!(err.status, Status::INVALID_ARGUMENT);
}
