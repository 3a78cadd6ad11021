// compose-check loads compose files the way `docker compose config` does (compose-go, the Compose
// specification's reference loader that Docker Compose v2 is built on): schema validation, interpolation of
// ${VARS} from the environment and .env, merging, normalization. It prints the resolved project as JSON, or the
// error and exit status 15. It exists because this project's machines have the docker client but no compose
// plugin; where `docker compose` is installed, scripts/compose-config.sh uses that instead.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/compose-spec/compose-go/v2/cli"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: compose-check compose.yaml [more.yaml ...]")
		os.Exit(2)
	}
	options, err := cli.NewProjectOptions(
		os.Args[1:],
		cli.WithOsEnv,
		cli.WithDotEnv,
		cli.WithDefaultProfiles(), // COMPOSE_PROFILES, as docker compose reads it
		cli.WithName("turnstream"),
		cli.WithResolvedPaths(true),
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(15)
	}
	project, err := options.LoadProject(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(15)
	}
	out, err := project.MarshalJSON()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(15)
	}
	os.Stdout.Write(out)
	fmt.Println()
}
