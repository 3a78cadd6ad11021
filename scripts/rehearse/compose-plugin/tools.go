//go:build tools

package tools

import _ "github.com/docker/compose/v2/cmd"
