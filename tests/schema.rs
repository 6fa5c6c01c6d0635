//! `tollgate schema`: the committed JSON Schemas are what the binary prints,
//! every example policy and keys file validates against them with a real
//! JSON Schema validator (Debian's python3-jsonschema, draft 2020-12), and
//! invalid fixtures that a schema can tell apart are rejected by it too.

use std::process::Command;

/// Debian's interpreter, which `make test` gives python3-jsonschema and
/// python3-yaml.
const PYTHON: &str = "/usr/bin/python3";

fn schema(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("schema")
        .args(args)
        .output()
        .expect("run tollgate schema");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn the_committed_schemas_are_what_the_binary_prints() {
    for (file, args) in [
        ("config/tollgate.schema.json", &[][..]),
        ("config/tollgate-keys.schema.json", &["--keys-file"][..]),
    ] {
        let committed = std::fs::read_to_string(file).expect(file);
        assert!(
            committed == schema(args),
            "{file} is stale: run `tollgate schema {} > {file}`",
            args.join(" ")
        );
    }
}

/// Validates each `schema_file=document` pair; prints one line per
/// document: `ok path` or `invalid path: first error`.
const VALIDATE: &str = r#"
import json, sys, yaml, jsonschema
for pair in sys.argv[1:]:
    schema_file, doc_file = pair.split("=", 1)
    schema = json.load(open(schema_file))
    jsonschema.Draft202012Validator.check_schema(schema)
    doc = yaml.safe_load(open(doc_file))
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=str)
    print(("invalid %s: %s" % (doc_file, errors[0].message)) if errors else "ok " + doc_file)
"#;

fn validate(pairs: &[(&str, String)]) -> Vec<String> {
    let out = Command::new(PYTHON)
        .arg("-c")
        .arg(VALIDATE)
        .args(pairs.iter().map(|(s, d)| format!("{s}={d}")))
        .output()
        .expect("python3 with jsonschema and yaml (make test installs them)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_example_policy_validates_and_names_its_schema() {
    let mut pairs = Vec::new();
    for entry in std::fs::read_dir("config").expect("config/") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|x| x != "yaml") {
            continue;
        }
        let path = path.to_str().expect("utf-8 path").to_owned();
        let text = std::fs::read_to_string(&path).expect("read");
        let schema = if text.contains("\nversion:") {
            "tollgate.schema.json"
        } else {
            "tollgate-keys.schema.json"
        };
        assert!(
            text.starts_with(&format!("# yaml-language-server: $schema=./{schema}\n")),
            "{path} starts with the modeline naming {schema}"
        );
        pairs.push((
            if schema.contains("keys") {
                "config/tollgate-keys.schema.json"
            } else {
                "config/tollgate.schema.json"
            },
            path,
        ));
    }
    assert!(pairs.len() >= 3, "{pairs:?}");
    for line in validate(&pairs) {
        assert!(line.starts_with("ok "), "{line}");
    }
}

/// Fixtures of tests/config that the schema alone rejects (the others
/// break rules across keys, which only `check` knows).
const REJECTED_BY_THE_SCHEMA: &[&str] = &[
    "unknown_field",
    "unknown_algorithm",
    "unsupported_version",
    "out_of_range",
    "bad_timeout",
    "respond_bad_status",
    "schema_misspelled_key",
    "schema_wrong_enum",
    "schema_wrong_type",
    "schema_threads_zero",
    "schema_routes_not_a_list",
];

#[test]
fn invalid_fixtures_are_rejected_by_the_schema_too() {
    let pairs: Vec<_> = REJECTED_BY_THE_SCHEMA
        .iter()
        .map(|name| {
            (
                "config/tollgate.schema.json",
                format!("tests/config/{name}.yaml"),
            )
        })
        .collect();
    let lines = validate(&pairs);
    assert_eq!(lines.len(), REJECTED_BY_THE_SCHEMA.len());
    for line in lines {
        assert!(line.starts_with("invalid "), "{line}");
    }
}
