//! The README's complete program is examples/readme.rs, verbatim: this test
//! fails when the two differ (naming the first differing line), and runs the
//! example's code, so the program a new user copies can neither rot nor
//! drift from what is tested.

mod readme {
    include!("../examples/readme.rs");

    #[test]
    fn the_readme_program_runs() {
        main().expect("the README's program failed");
    }
}

/// The ```rust block under "## A complete program" in README.md.
fn readme_program() -> String {
    let readme = include_str!("../README.md");
    let section = readme
        .find("## A complete program")
        .expect("README.md has no \"## A complete program\" section");
    let start = readme[section..]
        .find("```rust\n")
        .map(|i| section + i + "```rust\n".len())
        .expect("the section has no ```rust block");
    let end = readme[start..]
        .find("\n```\n")
        .map(|i| start + i + 1)
        .expect("the ```rust block is not closed");
    readme[start..end].to_owned()
}

#[test]
fn the_readme_program_is_examples_readme_rs() {
    let in_readme = readme_program();
    let example = include_str!("../examples/readme.rs");
    if in_readme != example {
        let line = in_readme
            .lines()
            .zip(example.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| in_readme.lines().count().min(example.lines().count()));
        panic!(
            "README.md's program and examples/readme.rs differ at line {} of the program:\n\
             README:  {:?}\nexample: {:?}",
            line + 1,
            in_readme.lines().nth(line),
            example.lines().nth(line)
        );
    }
}
