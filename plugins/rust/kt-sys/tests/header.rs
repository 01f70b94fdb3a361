//! Checks every declaration of this crate against kt_c_api.h by compiling a
//! C file that asserts them: each function is assigned to a pointer of the
//! type written here (a mismatch is an incompatible-pointer error), each
//! constant and each struct size, alignment and field offset is a
//! _Static_assert. The C compiler is the judge, so nothing is parsed by hand
//! except the list of names, used to report what the header has and this
//! crate does not declare yet.
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

const INCLUDE_DIR: &str = env!("KT_SYS_INCLUDE_DIR");
const DLPACK_INCLUDE_DIR: &str = env!("KT_SYS_DLPACK_INCLUDE_DIR");

/// Rust type as written in a declaration -> the C type it must be.
fn c_type(rust: &str) -> String {
    let spaced = rust.replace('*', " * ");
    let tokens: Vec<&str> = spaced.split_whitespace().collect();
    c_type_tokens(&tokens)
}

fn c_type_tokens(tokens: &[&str]) -> String {
    match tokens {
        ["*", "const", rest @ ..] => format!("{} const*", c_type_tokens(rest)),
        ["*", "mut", rest @ ..] => format!("{}*", c_type_tokens(rest)),
        [name] => match *name {
            "()" => "void".into(),
            "c_void" => "void".into(),
            "c_char" => "char".into(),
            "c_int" => "int".into(),
            "c_uint" => "unsigned int".into(),
            "f32" => "float".into(),
            "f64" => "double".into(),
            "i8" | "i16" | "i32" | "i64" => format!("int{}_t", &name[1..]),
            "u8" | "u16" | "u32" | "u64" => format!("uint{}_t", &name[1..]),
            "usize" => "size_t".into(),
            other => other.into(),
        },
        _ => panic!("kt-sys header check: cannot translate Rust type `{}`", tokens.join(" ")),
    }
}

fn probe_source() -> String {
    let mut c = String::new();
    c.push_str("#include <stddef.h>\n#include <stdint.h>\n#include <kt_c_api.h>\n\n");
    for (name, ret, params) in kt_sys::DECLARED_FUNCTIONS {
        let params: Vec<String> = params.iter().map(|p| c_type(p)).collect();
        let params = if params.is_empty() { "void".to_string() } else { params.join(", ") };
        writeln!(c, "/* {} */\nstatic {} (*const check_{})({}) = &{};", name, c_type(ret), name, params, name)
            .unwrap();
    }
    for (name, value) in kt_sys::DECLARED_CONSTANTS {
        writeln!(c, "_Static_assert({} == {}LL, \"kt-sys: {} is not {} in the header\");", name, value, name, value)
            .unwrap();
    }
    for (name, size, align, fields) in kt_sys::declared_layouts() {
        writeln!(c, "_Static_assert(sizeof({0}) == {1}, \"kt-sys: sizeof({0}) is not {1} in the header\");", name, size)
            .unwrap();
        writeln!(c, "_Static_assert(_Alignof({0}) == {1}, \"kt-sys: _Alignof({0}) is not {1} in the header\");", name, align)
            .unwrap();
        for (field, offset) in fields {
            writeln!(c, "_Static_assert(offsetof({0}, {1}) == {2}, \"kt-sys: {0}.{1} is not at offset {2} in the header\");",
                     name, field, offset)
                .unwrap();
        }
    }
    c
}

#[test]
fn declarations_match_the_header() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let source = dir.join("kt_sys_header_check.c");
    std::fs::write(&source, probe_source()).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let out = Command::new(&cc)
        .args(["-std=c11", "-fsyntax-only", "-Wall", "-Werror", "-Wno-unused", "-pedantic-errors"])
        .arg(format!("-I{}", INCLUDE_DIR))
        .arg(format!("-I{}", DLPACK_INCLUDE_DIR))
        .arg(&source)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {}", cc, e));
    assert!(
        out.status.success(),
        "kt-sys declarations differ from {}/kt_c_api.h:\n{}",
        INCLUDE_DIR,
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "{} functions, {} constants, {} structs match {}/kt_c_api.h",
        kt_sys::DECLARED_FUNCTIONS.len(),
        kt_sys::DECLARED_CONSTANTS.len(),
        kt_sys::declared_layouts().len(),
        INCLUDE_DIR
    );
}

/// Parts of the header this crate does not declare yet, by name prefix, each
/// with its reason. Every other function and enum value of the header must
/// be declared here: a header addition fails this test until it is bound or
/// listed. A prefix that no longer leaves anything out fails too, so the list
/// stays true.
const NOT_BOUND_YET: &[(&str, &str)] = &[
    ("kt_comm_", "communicators: the multi-process API has no Rust binding yet"),
    ("KT_COMM_", "communicator backends (kt_comm_*)"),
    ("kt_dist_", "distributed layers and their checkpoints: no Rust binding yet"),
    ("KT_DIST_", "distributed-layer modes (kt_dist_*)"),
];

/// Every `KT_API ... kt_name(` function and every `KT_NAME = value` enum
/// value of the header.
fn header_names(header: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut functions, mut values) = (BTreeSet::new(), BTreeSet::new());
    for line in header.lines() {
        let line = line.trim_start();
        if let Some(rest) = line.strip_prefix("KT_API ") {
            if let Some(open) = rest.find('(') {
                if let Some(name) = rest[..open].split(|c: char| !(c.is_alphanumeric() || c == '_')).last() {
                    if name.starts_with("kt_") {
                        functions.insert(name.to_string());
                    }
                }
            }
        } else if line.starts_with("KT_") && line.contains('=') {
            let name: String = line.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            values.insert(name);
        }
    }
    (functions, values)
}

/// The names the header has and this crate does not declare are exactly
/// those NOT_BOUND_YET leaves out (they are printed); the scan of the header
/// finds every function this crate declares, so an empty report cannot come
/// from a scan that found nothing.
#[test]
fn report_undeclared_names() {
    let header = std::fs::read_to_string(PathBuf::from(INCLUDE_DIR).join("kt_c_api.h")).unwrap();
    let (functions, values) = header_names(&header);
    let declared: BTreeSet<&str> = kt_sys::DECLARED_FUNCTIONS
        .iter()
        .map(|f| f.0)
        .chain(kt_sys::DECLARED_CONSTANTS.iter().map(|c| c.0))
        .collect();
    let unseen: Vec<&str> =
        kt_sys::DECLARED_FUNCTIONS.iter().map(|f| f.0).filter(|n| !functions.contains(*n)).collect();
    assert!(unseen.is_empty(), "the scan of kt_c_api.h missed functions kt-sys declares: {:?}", unseen);
    assert!(values.contains("KT_OK") && values.contains("KT_ARG_X"), "the scan of kt_c_api.h found no enum values");

    let missing: BTreeSet<&str> =
        functions.iter().chain(values.iter()).map(|n| n.as_str()).filter(|n| !declared.contains(n)).collect();
    let unexplained: Vec<&str> =
        missing.iter().copied().filter(|n| !NOT_BOUND_YET.iter().any(|(p, _)| n.starts_with(p))).collect();
    assert!(
        unexplained.is_empty(),
        "kt_c_api.h has names kt-sys neither declares nor lists in NOT_BOUND_YET: {:?}",
        unexplained
    );
    for (prefix, reason) in NOT_BOUND_YET {
        let left_out: Vec<&str> = missing.iter().copied().filter(|n| n.starts_with(prefix)).collect();
        assert!(!left_out.is_empty(), "NOT_BOUND_YET lists {} ({}), but kt-sys leaves none of it out", prefix, reason);
        println!("not declared yet, {} ({}): {:?}", prefix, reason, left_out);
    }
    println!(
        "the header has {} functions and {} enum values; kt-sys declares all but the {} listed",
        functions.len(),
        values.len(),
        missing.len()
    );
}
